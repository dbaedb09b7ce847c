"""The example zoo: small models that train on the CPU, shared by the examples, tests and benchmarks.

A Case bundles a model constructor, a deterministic batch maker and a loss; make_step() turns a
model, optimizer and loss into one full training iteration. CASES holds small hand-written models
(one iteration well under a second on one CPU thread); real_cases() adds real architectures from
torchvision and transformers, randomly initialised from local configurations.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

_REPO = Path(__file__).resolve().parent.parent


class MLP(nn.Module):
    """Feed-forward classifier on flat feature vectors."""

    def __init__(self, in_features: int = 784, hidden: int = 256, depth: int = 2, num_classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """Small convolutional classifier for 3x32x32 images."""

    def __init__(self, channels: Sequence[int] = (32, 64, 128), num_classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        width = 3
        for i, c in enumerate(channels):
            layers += [nn.Conv2d(width, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
            # Halve the resolution between stages; pool the last stage down to one value per channel.
            layers.append(nn.MaxPool2d(2) if i < len(channels) - 1 else nn.AdaptiveAvgPool2d(1))
            width = c
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class LSTMLM(nn.Module):
    """LSTM language model: embedding, 2-layer LSTM, linear to the vocabulary."""

    def __init__(self, vocab_size: int = 512, embed_dim: int = 64, hidden: int = 128, num_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=num_layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # (b, t, c) -> three (b, heads, t, head_dim) tensors
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-style decoder: token and position embeddings, causal blocks, final LayerNorm, lm head."""

    def __init__(self, vocab_size: int = 512, seq_len: int = 64, d_model: int = 128, n_heads: int = 4,
                 n_layers: int = 2):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@dataclass
class Case:
    """A training workload: model, batches of a given size (the same for every call), and loss."""

    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[int], tuple]  # n -> (inputs, targets)
    loss_fn: Callable[[Any, Any], torch.Tensor]  # (model output, targets) -> scalar loss
    default_batch: int


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _classification_batch(shape: Sequence[int], num_classes: int = 10) -> Callable[[int], tuple]:
    """Random inputs of `shape` per sample, with random class labels."""
    def make(n: int) -> tuple:
        g = _generator()
        return torch.randn(n, *shape, generator=g), torch.randint(num_classes, (n,), generator=g)
    return make


def _next_token_batch(vocab_size: int, seq_len: int) -> Callable[[int], tuple]:
    """Random token sequences; the targets are the inputs shifted by one."""
    def make(n: int) -> tuple:
        tokens = torch.randint(vocab_size, (n, seq_len + 1), generator=_generator())
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return make


def _token_batch(vocab_size: int, seq_len: int, num_labels: int | None = None) -> Callable[[int], tuple]:
    """Random token sequences with class labels, or (no num_labels) with themselves as targets."""
    def make(n: int) -> tuple:
        g = _generator()
        tokens = torch.randint(vocab_size, (n, seq_len), generator=g)
        return tokens, (tokens if num_labels is None else torch.randint(num_labels, (n,), generator=g))
    return make


def _sequence_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy over every position of (batch, seq, vocab) logits."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _shifted_sequence_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy: position i predicts token i + 1 (the Hugging Face convention)."""
    return _sequence_loss(logits[:, :-1], tokens[:, 1:])


CASES: dict[str, Case] = {
    "mlp": Case("mlp", MLP, _classification_batch((784,)), F.cross_entropy, 64),
    "cnn": Case("cnn", CNN, _classification_batch((3, 32, 32)), F.cross_entropy, 16),
    "lstm": Case("lstm", LSTMLM, _next_token_batch(512, 32), _sequence_loss, 16),
    "gpt": Case("gpt", GPT, _next_token_batch(512, 64), _sequence_loss, 8),
}


class HFLogits(nn.Module):
    """Wraps a Hugging Face model so that forward(input_ids) returns its logits tensor."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


def real_cases() -> dict[str, Case]:
    """Real architectures from torchvision, transformers and timm, randomly initialised from configurations
    built here (nothing is downloaded)."""
    import timm
    import torchvision.models as tvm
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    def bert() -> nn.Module:
        return HFLogits(BertForSequenceClassification(BertConfig(
            vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
            max_position_embeddings=128, num_labels=2, attn_implementation="sdpa")))

    def gpt2() -> nn.Module:
        return HFLogits(GPT2LMHeadModel(GPT2Config(
            vocab_size=1000, n_positions=64, n_embd=128, n_layer=2, n_head=4, use_cache=False,
            attn_implementation="sdpa")))

    return {
        "resnet18": Case("resnet18", lambda: tvm.resnet18(num_classes=10),
                         _classification_batch((3, 64, 64)), F.cross_entropy, 8),
        "mobilenet_v3_small": Case("mobilenet_v3_small", lambda: tvm.mobilenet_v3_small(num_classes=10),
                                   _classification_batch((3, 64, 64)), F.cross_entropy, 8),
        "bert": Case("bert", bert, _token_batch(1000, 32, num_labels=2), F.cross_entropy, 8),
        "gpt2": Case("gpt2", gpt2, _token_batch(1000, 32), _shifted_sequence_loss, 8),
        "vit_tiny": Case("vit_tiny", lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64,
                                                               num_classes=10),
                         _classification_batch((3, 64, 64)), F.cross_entropy, 8),
        "convnext_atto": Case("convnext_atto", lambda: timm.create_model("convnext_atto", pretrained=False,
                                                                         num_classes=10),
                              _classification_batch((3, 64, 64)), F.cross_entropy, 8),
    }


OPTIMIZERS = ("sgd", "adamw")


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    """"sgd": SGD(lr=0.01, momentum=0.9); "adamw": AdamW(lr=1e-3)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    raise ValueError(f"unknown optimizer {name!r}; valid names: {', '.join(OPTIMIZERS)}")


def make_step(model: nn.Module, optimizer: torch.optim.Optimizer,
              loss_fn: Callable[[Any, Any], torch.Tensor]) -> Callable[[tuple], torch.Tensor]:
    """step(batch): one full training iteration on (inputs, targets); returns the loss, detached."""
    def step(batch: tuple) -> torch.Tensor:
        inputs, targets = batch
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


def _import_gpucast():
    """Import gpucast, from this source tree's python/ directory when it is not installed."""
    try:
        import gpucast
    except ModuleNotFoundError as e:
        if e.name != "gpucast":
            raise
        sys.path.insert(0, str(_REPO / "python"))
        import gpucast
    return gpucast


def run_example(case_name: str, argv: Sequence[str] | None = None) -> int:
    """The examples' command line: train CASES[case_name] on the CPU, tracing iteration 2 with gpucast."""
    case = CASES[case_name]
    parser = argparse.ArgumentParser(
        description=f"Train the zoo {case_name} model on the CPU; trace iteration 2 with gpucast and "
                    "print the trace's summary; then forecast the step at a larger batch on this CPU, measure "
                    "it, and forecast the run on a GPU.")
    parser.add_argument("--batch-size", type=int, default=case.default_batch,
                        help=f"samples per batch (default {case.default_batch})")
    parser.add_argument("--steps", type=int, default=3,
                        help="training iterations in all; iteration 2 is traced (default 3)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="(default adamw)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--save", metavar="PATH", help="write the trace as JSON (load with gpucast.load_trace)")
    parser.add_argument("--chrome", metavar="PATH", help="write the trace as a Chrome trace event file")
    parser.add_argument("--no-trace", action="store_true", help="train only; gpucast is not loaded")
    parser.add_argument("--forecast-batch", type=int, default=4 * case.default_batch,
                        help="after training, forecast the step at this batch on this CPU and measure it "
                             f"(default {4 * case.default_batch}; 0: no forecasts)")
    parser.add_argument("--target", default="H100-80GB",
                        help="and forecast the run on this GPU (a name from `python -m gpucast devices`; "
                             "default H100-80GB; '' for none)")
    parser.add_argument("--dp", type=int, default=8,
                        help="data-parallel ranks on the GPU target, each with --forecast-batch samples "
                             "(default 8)")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.threads < 1:
        parser.error("--batch-size and --threads must be at least 1")
    if args.forecast_batch < 0 or args.dp < 1:
        parser.error("--forecast-batch must be at least 0 and --dp at least 1")
    if args.no_trace:
        if args.save or args.chrome:
            parser.error("--save and --chrome need a trace; drop --no-trace")
        if args.steps < 1:
            parser.error("--steps must be at least 1")
    elif args.steps < 2:
        parser.error("--steps must be at least 2 to trace iteration 2 (or pass --no-trace)")

    gpucast = None if args.no_trace else _import_gpucast()  # loads the plugin before training starts
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = case.make_model()
    optimizer = make_optimizer(args.optimizer, model.parameters())
    step = make_step(model, optimizer, case.loss_fn)
    batch = case.make_batch(args.batch_size)

    traced = None
    for i in range(1, args.steps + 1):
        if gpucast is not None and i == 2:
            with gpucast.trace() as traced:
                loss = step(batch)
            print(f"step {i} loss {loss.item():.4f} (traced)")
        else:
            print(f"step {i} loss {step(batch).item():.4f}")

    if traced is not None:
        print(traced.summary())
        if args.save:
            traced.save(args.save)
            print(f"saved trace to {args.save}")
        if args.chrome:
            traced.save_chrome(args.chrome)
            print(f"saved Chrome trace to {args.chrome}")
    if gpucast is not None and args.forecast_batch:
        _forecast_and_measure(gpucast, case, model, optimizer, step, args)
    return 0


def _forecast_and_measure(gpucast, case: Case, model: nn.Module, optimizer: torch.optim.Optimizer,
                          step: Callable[[tuple], torch.Tensor], args: argparse.Namespace) -> None:
    """The examples' forecasts: the step at --forecast-batch on this CPU, then measured; the run on --target."""
    import statistics
    import time
    b = args.forecast_batch
    print(f"\ngpucast.forecast: batch {b} on this CPU ({args.threads} thread(s)), from probes at small batches")
    fc = gpucast.forecast(step, case.make_batch, b, model=model, optimizer=optimizer, target="cpu",
                          time_fraction=0.25)
    print(fc)
    big = case.make_batch(b)
    step(big)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        step(big)
        times.append((time.perf_counter() - t0) * 1e3)
    measured = statistics.median(times)
    print(f"measured: the step at batch {b} takes {measured:,.1f} ms (median of 10 steps, "
          f"{min(times):,.1f}-{max(times):,.1f}); forecast {fc.time.step_ms:,.1f} ms, "
          f"{100 * (fc.time.step_ms - measured) / measured:+.1f} %")
    del big
    if args.target:
        parallel = {"dp": args.dp} if args.dp > 1 else None
        print(f"\ngpucast.forecast: batch {b * args.dp} on {args.target}"
              f"{f' with {args.dp} data-parallel ranks' if args.dp > 1 else ''}, from probes on this CPU")
        print(gpucast.forecast(step, case.make_batch, b * args.dp, model=model, optimizer=optimizer,
                               target=args.target, parallel=parallel))
