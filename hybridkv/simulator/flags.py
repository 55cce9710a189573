"""Range checks of the command line's number flags, before any model sees them.

argparse checks that ``--max-model-len`` is an int; whether the int makes sense is checked here,
so the refusal names the flag the user typed and an example that works, not the model's own
name for the setting (``max_model_len``).
"""

from __future__ import annotations

from hybridkv.errors import HybridKVConfigError

__all__ = ["require_at_least"]


def require_at_least(flag: str, value: int | None, low: int, example: int) -> None:
    """Refuse ``value`` below ``low`` (``None``, the flag left out, passes).

    Refusal: :class:`HybridKVConfigError` naming ``flag``, the value and ``example`` as the fix.
    """
    if value is not None and value < low:
        raise HybridKVConfigError(
            flag, value, f"must be an int >= {low}", f"pass e.g. {flag} {example}"
        )
