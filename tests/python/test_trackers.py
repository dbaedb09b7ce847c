"""Trackers and framework callbacks, with the real libraries, read back with their own readers."""
import json
import os
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import gpucast
from gpucast import trackers
from examples import zoo

MIB = 2**20


@pytest.fixture(autouse=True)
def no_leftover_loggers():
    yield
    for logger in list(trackers._loggers):
        logger.close()


def forecast_and_train(steps=3, target="A100-80GB"):
    torch.manual_seed(0)
    case = zoo.CASES["mlp"]
    model = case.make_model()
    opt = zoo.make_optimizer("adamw", model.parameters())
    step = zoo.make_step(model, opt, case.loss_fn)
    fc = gpucast.forecast(step, case.make_batch, 64, model=model, optimizer=opt, target=target)
    for _ in range(steps):
        step(case.make_batch(64))
    return fc


def test_tensorboard_event_files(tmp_path):
    from torch.utils.tensorboard import SummaryWriter
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    writer = SummaryWriter(str(tmp_path))
    gpucast.log_to(writer)
    fc = forecast_and_train()
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    forecast = acc.Scalars("gpucast/forecast_peak_allocated_mib")
    assert forecast[0].value == pytest.approx(fc.memory.peak_allocated_bytes / MIB, rel=1e-6)
    assert [e.step for e in acc.Scalars("gpucast/measured_peak_allocated_mib")] == [1, 2, 3]
    assert acc.Scalars("gpucast/max_batch_size")[0].value == fc.memory.max_batch_size
    assert "gpucast/forecast/text_summary" in acc.Tags()["tensors"]


def test_mlflow_file_store(tmp_path, monkeypatch):
    import mlflow
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this switch
    mlflow.set_tracking_uri(f"file:{tmp_path / 'mlruns'}")
    with mlflow.start_run() as run:
        gpucast.log_to(mlflow)
        fc = forecast_and_train()
    client = mlflow.MlflowClient()
    data = client.get_run(run.info.run_id).data
    assert data.params["gpucast_target"] == "A100-80GB" and data.params["gpucast_batch_size"] == "64"
    history = client.get_metric_history(run.info.run_id, "gpucast/forecast_peak_reserved_mib")
    assert history[0].value == pytest.approx(fc.memory.peak_reserved_bytes / MIB, rel=1e-6)
    measured = client.get_metric_history(run.info.run_id, "gpucast/measured_peak_allocated_mib")
    assert sorted(m.step for m in measured) == [1, 2, 3]
    doc = mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/gpucast_forecast.json")
    assert doc["memory"]["peak_allocated_bytes"] == fc.memory.peak_allocated_bytes
    assert doc["schema_version"] == 2  # to_dict()'s schema (b29aa05: null for what does not apply)


def wandb_log_records(path):
    """Records of a .wandb file: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of
    (crc32 4 B, length 2 B, type 1 B: full, first, middle, last) chunks."""
    import struct
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
        else:
            break


def test_wandb_offline_run(tmp_path, monkeypatch):
    import wandb
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(mode="offline", dir=str(tmp_path), project="gpucast-test")
    gpucast.log_to(run)
    fc = forecast_and_train()
    assert run.config["gpucast"]["memory"]["peak_allocated_bytes"] == fc.memory.peak_allocated_bytes
    assert run.summary["gpucast/forecast_peak_reserved_mib"] == pytest.approx(fc.memory.peak_reserved_bytes / MIB)
    run.finish()
    # Read the offline run's file back: wandb's record protos, in its LevelDB-style log.
    from wandb.proto import wandb_internal_pb2 as pb
    files = list(tmp_path.rglob("run-*.wandb"))
    assert len(files) == 1
    # wandb's service may still be writing the file when finish() returns (now and then it holds only its
    # header): read it once its exit record is there.
    deadline = time.monotonic() + 30
    while True:
        records = [pb.Record.FromString(data) for data in wandb_log_records(files[0])]
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert any(r.WhichOneof("record_type") == "exit" for r in records), "the offline run's file has no exit record"
    config, summary, history = {}, {}, []
    for rec in records:
        kind = rec.WhichOneof("record_type")
        def items(seq):
            return {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in seq}
        if kind == "config":
            config.update(items(rec.config.update))
        elif kind == "run":  # config set before the run record was written travels inside it
            config.update(items(rec.run.config.update))
        elif kind == "summary":
            summary.update(items(rec.summary.update))
        elif kind == "history":
            history.append(items(rec.history.item))
    assert config["gpucast"]["memory"]["peak_allocated_bytes"] == fc.memory.peak_allocated_bytes
    assert summary["gpucast/forecast_peak_reserved_mib"] == pytest.approx(fc.memory.peak_reserved_bytes / MIB)
    assert [h["_step"] for h in history if "gpucast/measured_peak_allocated_mib" in h] == [1, 2, 3], history[:2]


def test_json_lines_and_a_tracker_without_a_run(tmp_path, monkeypatch):
    import mlflow
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    path = tmp_path / "f.jsonl"
    mlflow.set_tracking_uri(f"file:{tmp_path / 'mlruns'}")
    with pytest.warns(UserWarning, match=r"gpucast.log_to: not logging to module: MLflow has no active run: start one "
                                         r"with mlflow.start_run\(\); gpucast goes on"):
        gpucast.log_to(mlflow, str(path))
    fc = forecast_and_train(steps=2)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["forecast", "measured", "measured"]
    assert lines[0]["memory"]["peak_allocated_bytes"] == fc.memory.peak_allocated_bytes
    assert lines[1]["gpucast/forecast_peak_allocated_mib"] == pytest.approx(fc.memory.peak_allocated_bytes / MIB)
    assert lines[1]["gpucast/measured_step_ms"] > 0 and lines[2]["gpucast/measured_step_ms"] > 0


def test_unwritable_jsonl_path_is_named():
    with pytest.raises(OSError, match=r"cannot write '/nonexistent-dir/f.jsonl'"):
        gpucast.log_to("/nonexistent-dir/f.jsonl")


class LitMLP(__import__("pytorch_lightning").LightningModule):
    def __init__(self):
        super().__init__()
        self.net = zoo.MLP()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def test_lightning_trainer_fit(tmp_path):
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from gpucast.integrations.lightning import GpucastCallback
    x, y = zoo.CASES["mlp"].make_batch(128)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    cb = GpucastCallback(target="cpu", capacity_mb=1, log=[str(tmp_path / "f.jsonl")])
    logger = TensorBoardLogger(str(tmp_path), name="lit")
    trainer = pl.Trainer(max_steps=4, callbacks=[cb], logger=logger, accelerator="cpu", devices=1,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        trainer.fit(LitMLP(), loader)
    m = cb.forecast.memory
    assert cb.forecast.probe_batch_sizes == (2, 4, 8)  # probed at train start, before the first full step
    assert m.target == "cpu" and m.batch_size == 32 and m.peak_allocated_bytes > 1 * MIB
    assert sum("out-of-memory risk on cpu" in str(x.message) for x in w) == 1
    logger.experiment.flush()
    acc = EventAccumulator(logger.log_dir)
    acc.Reload()
    assert acc.Scalars("gpucast/forecast_peak_allocated_mib")[0].value == pytest.approx(m.peak_allocated_bytes / MIB)
    assert [e.step for e in acc.Scalars("gpucast/measured_peak_allocated_mib")] == [1, 2, 3, 4]
    kinds = [json.loads(x)["kind"] for x in (tmp_path / "f.jsonl").read_text().splitlines()]
    assert kinds == ["forecast", "measured", "measured", "measured", "measured"]


def test_transformers_trainer_train(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from gpucast.integrations.transformers import GpucastCallback
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                       use_cache=False))
    ids = torch.randint(0, 1000, (32, 32), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": r, "labels": r} for r in ids]
    cb = GpucastCallback(target="H100-80GB", log=[str(tmp_path / "f.jsonl")])
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=3,
                             report_to="none", use_cpu=True, logging_steps=1, save_strategy="no",
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    trainer.train()
    m = cb.forecast.memory
    assert cb.forecast.probe_batch_sizes == (2, 4, 8)
    assert m.target == "H100-80GB" and m.batch_size == 8 and m.peak_reserved_bytes >= m.peak_allocated_bytes > 0
    entries = [e for e in trainer.state.log_history if "gpucast/forecast_peak_allocated_bytes" in e]
    assert entries == [{"step": 0, "gpucast/forecast_peak_allocated_bytes": m.peak_allocated_bytes,
                        "gpucast/forecast_peak_reserved_bytes": m.peak_reserved_bytes, "gpucast/target": "H100-80GB"}]
    kinds = [json.loads(x)["kind"] for x in (tmp_path / "f.jsonl").read_text().splitlines()]
    assert kinds == ["forecast", "measured", "measured", "measured"]


def test_step_time_forecast_beside_measured(tmp_path):
    """Target cpu: the forecast has a step time; trackers get it beside the measured step times."""
    path = tmp_path / "t.jsonl"
    gpucast.log_to(str(path))
    fc = forecast_and_train(steps=2, target="cpu")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["forecast", "measured", "measured"]
    assert lines[0]["time"]["step_ms"] == fc.time.step_ms > 0
    assert [x["layer"] for x in lines[0]["time"]["per_layer"]] == [
        "MLP.net.0", "MLP.net.1", "MLP.net.2", "MLP.net.3", "MLP.net.4", "(outside modules)"]
    for x in lines[1:]:
        assert x["gpucast/forecast_step_ms"] == pytest.approx(fc.time.step_ms)
        assert x["gpucast/forecast_exposed_comm_ms"] == 0.0
        assert x["gpucast/measured_step_ms"] > 0


def csv_rows(path):
    import csv
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_lightning_logs_through_any_logger(tmp_path):
    """CSVLogger (no SummaryWriter underneath) and TensorBoardLogger at once: both get the forecast, its
    parameters and the measured peaks, through Lightning's own logger API."""
    import pytorch_lightning as pl
    import yaml
    from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from gpucast.integrations.lightning import GpucastCallback
    x, y = zoo.CASES["mlp"].make_batch(128)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    cb = GpucastCallback(target="cpu")
    csv_logger, tb_logger = CSVLogger(str(tmp_path), name="csv"), TensorBoardLogger(str(tmp_path), name="tb")
    trainer = pl.Trainer(max_steps=4, callbacks=[cb], logger=[csv_logger, tb_logger], accelerator="cpu", devices=1,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        trainer.fit(LitMLP(), loader)
    assert not [str(x.message) for x in w if "gpucast: not logging" in str(x.message)]
    m = cb.forecast.memory
    rows = csv_rows(Path(csv_logger.log_dir) / "metrics.csv")
    forecast = [r for r in rows if r.get("gpucast/forecast_peak_reserved_mib")]
    assert forecast[0]["step"] == "0"
    assert float(forecast[0]["gpucast/forecast_peak_reserved_mib"]) == pytest.approx(m.peak_reserved_bytes / MIB)
    assert float(forecast[0]["gpucast/forecast_peak_allocated_mib"]) == pytest.approx(m.peak_allocated_bytes / MIB)
    assert [int(r["step"]) for r in rows if r.get("gpucast/measured_peak_allocated_mib")] == [1, 2, 3, 4]
    hparams = yaml.safe_load((Path(csv_logger.log_dir) / "hparams.yaml").read_text())
    assert hparams["gpucast_target"] == "cpu" and str(hparams["gpucast_batch_size"]) == "32"
    acc = EventAccumulator(tb_logger.log_dir)
    acc.Reload()
    assert acc.Scalars("gpucast/forecast_peak_reserved_mib")[0].value == pytest.approx(m.peak_reserved_bytes / MIB)
    assert [e.step for e in acc.Scalars("gpucast/measured_peak_allocated_mib")] == [1, 2, 3, 4]


class LogsRecorder(__import__("transformers").TrainerCallback):
    """Stands for any reporter: what on_log hands it, at which step."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append((state.global_step, dict(logs)))


def tiny_gpt2_trainer(tmp_path, callbacks, report_to):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                       use_cache=False))
    ids = torch.randint(0, 1000, (32, 32), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=3,
                             report_to=report_to, logging_dir=str(tmp_path / "tb"), use_cpu=True, logging_steps=100,
                             save_strategy="no", disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids],
                   callbacks=callbacks)


def test_transformers_values_reach_every_reporter(tmp_path):
    """report_to=["tensorboard"] and a reporter placed before gpucast's callback: both get the forecast and the
    measured peaks of the first steps (logging_steps=100: the Trainer itself logs nothing in 3 steps)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from gpucast.integrations.transformers import GpucastCallback
    recorder, cb = LogsRecorder(), GpucastCallback(target="H100-80GB")
    trainer = tiny_gpt2_trainer(tmp_path, [recorder, cb], ["tensorboard"])
    trainer.train()
    m = cb.forecast.memory
    forecast = [(s, x) for s, x in recorder.logs if "gpucast/forecast_peak_reserved_mib" in x]
    assert forecast[0][1]["gpucast/forecast_peak_reserved_mib"] == pytest.approx(m.peak_reserved_bytes / MIB)
    assert forecast[0][1]["gpucast/forecast_peak_allocated_mib"] == pytest.approx(m.peak_allocated_bytes / MIB)
    assert [s for s, x in recorder.logs if "gpucast/measured_peak_allocated_mib" in x] == [1, 2, 3]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tb = acc.Scalars("train/gpucast/forecast_peak_reserved_mib")
    assert tb[0].value == pytest.approx(m.peak_reserved_bytes / MIB)
    assert [e.step for e in acc.Scalars("train/gpucast/measured_peak_allocated_mib")] == [1, 2, 3]


def test_a_tracker_whose_package_is_missing(monkeypatch):
    """One warning line naming the package and its pip command; gpucast goes on."""
    run = type("ActiveRun", (), {"__module__": "mlflow.tracking.fluent"})()  # an MLflow run, as gpucast sees one
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if mlflow were not installed
    with pytest.warns(UserWarning) as w:
        logger = gpucast.log_to(run)
    assert [str(x.message) for x in w] == ["gpucast.log_to: not logging to ActiveRun: logging to MLflow needs mlflow: "
                                           "pip install mlflow; gpucast goes on"]
    assert logger.adapters == []
