"""The Environment section of one machine: every field of its environment record
(:func:`fastattn.bench.environment.collect`, or the asv adapter's), each value in words:
first the fields the schema labels, in its order, then every other one by its key."""

from ..bench import schema
from ..bench.table import format_bytes

#: ``{dotted path: label}`` of the schema's environment fields (none before it has them).
LABELS = dict((path, label) for label, path in getattr(schema, "ENVIRONMENT_FIELDS", ()))

#: Fields of the record that say what it is rather than where it was measured.
_RECORD_FIELDS = ("schema", "record")


def blas_text(value):
    """threadpoolctl BLAS entries to ``"openblas 0.3.27, Haswell kernel, 2 threads (lib.so)"``."""
    parts = []
    for info in value if isinstance(value, list) else [value]:
        if not isinstance(info, dict):
            parts.append(str(info))
            continue
        text = f"{info.get('internal_api') or 'BLAS'} {info.get('version') or ''}".strip()
        if info.get("architecture"):
            text += f", {info['architecture']} kernel"
        if info.get("num_threads") is not None:
            text += f", {info['num_threads']} threads"
        owner = info.get("prefix") or info.get("filepath")
        parts.append(text + (f" ({str(owner).rsplit('/', 1)[-1]})" if owner else ""))
    return "; ".join(parts) or "–"


def value_text(value, key=""):
    """A recorded value in words: yes/no, bytes, lists and mappings joined, "–" for None."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {value_text(v)}" for k, v in value.items()) or "none"
    if isinstance(value, (list, tuple)):
        return ", ".join(value_text(v) for v in value) or "none"
    if key.endswith("_bytes") and value is not None:
        return format_bytes(value)
    return "–" if value is None else str(value)


def environment_rows(env, labels=None):
    """``(label, text)`` per field of ``env``: those of ``labels`` (``{dotted path: label}``,
    default :data:`LABELS`) first in its order, then the others by their dotted path in the
    record's order; each library of ``versions`` a row of its own (None: "not installed"),
    ``blas`` by :func:`blas_text`, the rest by :func:`value_text`."""
    labels = LABELS if labels is None else labels
    fields = {}
    for key, value in env.items():
        if key == "versions" and isinstance(value, dict):
            fields.update((f"versions.{lib}", "not installed" if v is None else str(v))
                          for lib, v in value.items())
        elif key not in _RECORD_FIELDS:
            fields[key] = blas_text(value) if key == "blas" else value_text(value, key)
    order = [path for path in labels if path in fields] + [p for p in fields if p not in labels]
    return [(labels.get(path, path), fields[path]) for path in order]


def section(m):
    """The Environment block of machine ``m`` (:class:`~.analysis.Machine`)."""
    return {"rows": environment_rows(m.env)}
