"""The errors edgespec raises on purpose. Each message says what was wrong and what to do."""


class EdgespecError(Exception):
    """Base class: anything the user can fix. The CLI prints the message on one line, exit 1."""


class ExportError(EdgespecError):
    """A checkpoint could not be exported or its ONNX graph failed validation."""


class IncompatiblePairError(ExportError):
    """Target and draft cannot be paired: tokenizers or special tokens differ."""


class ManifestError(EdgespecError):
    """An exported package is missing files, or its manifest or tokenizer is unreadable or
    does not fit the models."""


class GenerationError(EdgespecError):
    """A generation request cannot be served (a prompt that is empty, too long or not text)."""


class ChatTemplateError(EdgespecError):
    """The package has no chat template, or its template refused or failed the conversation."""


class TokenizerError(EdgespecError):
    """The package's tokenizer failed, panicked, or passed its time or memory limit."""


class ConfigError(EdgespecError, ValueError):
    """A setting has the wrong type or is out of range. Also a ValueError, so callers that
    caught the ValueError these settings raised before still catch it."""


def one_line(error: BaseException | str, limit: int | None = 200) -> str:
    """An error's message (another library's, often multi-line) on one line, for ours: its
    whitespace runs made single spaces, cut to ``limit`` characters (None: not cut) with "..."."""
    text = " ".join(str(error).split())
    if limit is None or len(text) <= limit:
        return text
    return text[: limit - 3] + "..."


def shown(value: object, limit: int = 80) -> str:
    """A value from a file (a name, a key, a setting) as a message may show it: its repr, so a
    string is quoted and no control character (a terminal's escape sequence) reaches the terminal
    raw, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
