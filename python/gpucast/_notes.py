"""A forecast's notes and warnings as Python holds them: {"code", "text"} (gpucast/note.h)."""


def note(code: str, text: str) -> dict:
    """A forecast's note or warning: a stable code (what callers and tests act on) and its text (gpucast/note.h)."""
    return {"code": code, "text": text}
