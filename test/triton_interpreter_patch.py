"""Makes the Triton interpreter skip re-patching triton.language on each @triton.jit helper call inside a kernel.

The interpreter patches the language modules a kernel's module sees once per launch, then again on every call of a
jit'd helper (attend_paged_keys, and Triton's own tl.zeros, tl.max and tl.sum), and never restores a helper's patch.
A re-patch of a module whose builtins are already the interpreter's changes nothing; thousands of them per engine
step took a sixth of the engine cases' time under Triton 3.9. So a call is skipped exactly when every language
module the function sees, and the tensor class, are patched already (their builtins replaced); any other call,
the launch's own first among them, patches as before. Without the internals this relies on (another Triton),
`install` leaves the interpreter as it is.
"""

from __future__ import annotations

from typing import Any, Callable


def install() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    if not all(hasattr(interpreter, n) for n in ("_patch_lang", "_LangPatchScope")):
        return
    patch_lang: Callable = interpreter._patch_lang
    is_builtin: Callable = tl.core.is_builtin

    def patched(fn: Callable) -> bool:
        langs = [m for m in fn.__globals__.values() if m is tl or m is tl.core]
        return bool(langs) and not is_builtin(tl.core.tensor.__add__) and not any(is_builtin(m.full) for m in langs)

    def patch_once(fn: Callable) -> Any:
        return interpreter._LangPatchScope() if patched(fn) else patch_lang(fn)

    interpreter._patch_lang = patch_once
