"""One test process's compiled programs kept by what they compile, not by the function that
asked for them.

A test that calls `main()` again (the same command resumed, then eval, score, infer) or
builds a second `Trainer` of the same model lowers the same programs again, and jax's own
caches, keyed by the Python function, compile each anew: on 2 CPU cores compiling is most
of such a test's time. jax's persistent cache would find them by their text, but it writes
and reads each executable serialized, and a test process died twice inside that read or
write (see conftest); here the compiled executable itself is kept, in memory, under jax's
own cache key (the module's text, the devices, the compile options, the backend and the
XLA flags). A program with host callbacks (`pure_callback`, `io_callback`, Pallas run by
the interpreter through them) is bound to its own callbacks and always compiled anew, as
is one compiled for profile-guided optimisation.

`install()` once at startup; `clear()` wherever jax's caches are cleared.
"""

from jax._src import cache_key, compiler

MOST = 256  # executables kept, the least recently used let go first
_kept: dict[str, object] = {}
_compile = compiler.compile_or_get_cached


def _compile_or_reuse(backend, computation, devices, compile_options, host_callbacks,
                      executable_devices, pgle_profiler=None):
    if host_callbacks or pgle_profiler is not None:
        return _compile(backend, computation, devices, compile_options, host_callbacks,
                        executable_devices, pgle_profiler)
    key = cache_key.get(computation, devices, compile_options, backend)
    if key in _kept:
        _kept[key] = _kept.pop(key)  # (the most recently used last)
    else:
        _kept[key] = _compile(backend, computation, devices, compile_options, host_callbacks,
                              executable_devices, pgle_profiler)
        if len(_kept) > MOST:
            del _kept[next(iter(_kept))]
    return _kept[key]


def install() -> None:
    compiler.compile_or_get_cached = _compile_or_reuse


def clear() -> None:
    _kept.clear()


def size() -> int:
    return len(_kept)
