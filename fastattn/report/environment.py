"""The Environment section of one machine: every field of its environment record in words,
those the schema labels (:data:`~fastattn.bench.schema.ENVIRONMENT_FIELDS`) first."""

from ..bench import schema
from ..bench.table import format_bytes

#: ``{dotted path: label}`` of the schema's environment fields.
LABELS = {path: label for label, path in schema.ENVIRONMENT_FIELDS}
NAV = "Environment"


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


def value_text(value):
    """A recorded value in words: yes/no, lists and mappings joined, "–" for None."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {value_text(v)}" for k, v in value.items()) or "none"
    if isinstance(value, (list, tuple)):
        return ", ".join(value_text(v) for v in value) or "none"
    return "–" if value is None else str(value)


def _field_text(env, path, value):
    if path == "blas":
        return blas_text(value)
    if path == "memory_total_bytes":
        return f"{format_bytes(value)} total" + (
            f", {format_bytes(env['memory_available_bytes'])} available at the start"
            if env.get("memory_available_bytes") else "")
    if value is None and path.startswith("versions."):
        return "not installed"
    return value_text(value)


#: Words for fields the schema does not label, by top-level key (``{sub}``: the key within).
REST_WORDS = {"versions": "{sub} version", "absent_peers": "How to install the {sub} peer"}


def rest_label(key, sub=None):
    """A field without a schema label in words: ``versions.jax`` "jax version", an unknown
    ``run_id`` "Run id", ``new_field.a`` "New field, a"."""
    if key in REST_WORDS and sub is not None:
        return REST_WORDS[key].format(sub=sub)
    text = key.replace("_", " ")
    return text[:1].upper() + text[1:] + ("" if sub is None else f", {sub}")


def environment_rows(env, labels=None):
    """``rows, rest`` of the environment record ``env``: ``(label, text)`` of each field of
    ``labels`` (``{dotted path: label}``, default :data:`LABELS`) it holds, in their order,
    and ``(words, text)`` of every other field (:func:`rest_label`; ``rest`` is ``rows``
    without a label)."""
    rows, used = [], {"memory_available_bytes", "schema", "record"}
    for path, label in (LABELS if labels is None else labels).items():
        key, _, sub = path.partition(".")
        holder = env.get(key) if sub else env
        if isinstance(holder, dict) and (sub or key) in holder:
            used.add(path)
            rows.append((label, _field_text(env, path, holder[sub or key])))
    rest = []
    for key, value in env.items():
        items = value.items() if isinstance(value, dict) and key != "blas" else [(None, value)]
        for sub, item in items:
            path = key if sub is None else f"{key}.{sub}"
            if path not in used and key not in used:
                rest.append((rest_label(key, sub), _field_text(env, path, item)))
    return (rows, rest) if rows else (rest, [])


def section(m):
    """The Environment block of machine ``m`` (:class:`~.analysis.Machine`)."""
    return dict(zip(("rows", "rest"), environment_rows(m.env)))
