"""Makes the Triton interpreter skip re-patching triton.language on each @triton.jit helper call inside a kernel.

The interpreter patches triton.language once per launch (and restores it after), then again on every call of a
jit'd helper (attend_paged_keys and the like), where the patch finds the launch's own patch in place and changes
nothing. That no-op, thousands of times per engine step, took about a quarter of the engine cases' time. A helper
whose module sees a language module the launch did not patch still gets its patch. Without the internals this
relies on (another Triton), `install` leaves the interpreter as it is.
"""

from __future__ import annotations

from typing import Any, Callable


def install() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    if not all(hasattr(interpreter, n) for n in ("GridExecutor", "_patch_lang", "_LangPatchScope")):
        return
    launches: list[list[Any]] = []  # per running launch: [ids of the language modules it patched, patched yet]
    patch_lang: Callable = interpreter._patch_lang
    grid_call: Callable = interpreter.GridExecutor.__call__

    def languages(fn: Callable) -> set[int]:
        return {id(m) for m in fn.__globals__.values() if m is tl or m is tl.core}

    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        launches.append([languages(self.fn), False])
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launches.pop()

    def patch_once(fn: Callable) -> Any:
        if launches:
            patched, done = launches[-1]
            if done and languages(fn) <= patched:
                return interpreter._LangPatchScope()  # nothing to restore: the launch's patch stays in place
            launches[-1][1] = True  # the first patch of a launch is its own (GridExecutor's)
        return patch_lang(fn)

    interpreter.GridExecutor.__call__ = launch
    interpreter._patch_lang = patch_once
