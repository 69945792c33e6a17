"""`GrammarChecker`: the gateway compiles every output constraint once before it queues the
request, so that a spec the engine could not enforce is a 400 naming what is wrong, not a
failed request later.

The grammar backend is the engine's (`--structured-output-backend`, a plugin without torch),
built at first use. Compiling runs in threads of its own with a timeout
(`--structured-output-compile-timeout`), never on the event loop. llguidance's regexes are
derivative-based, so no classic ReDoS goes exponential, but a spec that compiles too slowly
is refused all the same. Results, good and bad, are cached by `StructuredOutputsParams.cache_key`,
so a repeated spec costs one dictionary lookup.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from pagedserve.common.contracts import GrammarError, StructuredOutputBackend
from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.structured_outputs import StructuredOutputsParams

_OK = ""  # the cache's mark of a spec that compiled


class GrammarChecker:
    def __init__(self, backend_factory: Callable[[], StructuredOutputBackend], max_chars: int,
                 compile_timeout: float, threads: int = 2, cache_size: int = 1024):
        self._factory = backend_factory
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self.max_chars = max_chars
        self.compile_timeout = compile_timeout
        self._threads = threads
        #: made at first use, and again after `close` (an app's lifespan may start again)
        self._executor: ThreadPoolExecutor | None = None
        self._cache_size = cache_size
        # cache key → an error message, _OK, or the compile still running
        self._cache: OrderedDict[str, str | Future[str]] = OrderedDict()

    async def check(self, spec: StructuredOutputsParams, param: str) -> None:
        """Raise `InvalidParameterError(param, ...)` when `spec` is too large, does not compile,
        asks for what the backend cannot enforce (named), or takes too long to compile."""
        size = spec.spec_size
        if size > self.max_chars:
            raise InvalidParameterError(param, f"the {spec.kind} spec has {size} characters; this server takes at most "
                                               f"{self.max_chars} (--max-structured-output-chars)")
        key = spec.cache_key()
        entry = self._cache.get(key)
        if entry is None or (isinstance(entry, Future) and entry.cancelled()):  # cancelled by `close`
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="grammar-check")
            entry = self._executor.submit(self._compile, spec)
            self._remember(key, entry)
        else:
            self._cache.move_to_end(key)
        if isinstance(entry, Future):
            try:
                result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(entry)), self.compile_timeout)
            except asyncio.CancelledError:
                cancelling = getattr(asyncio.current_task(), "cancelling", None)  # Python 3.11+
                if not entry.cancelled() or (cancelling is not None and cancelling()):
                    raise  # this request was cancelled, not the compile
                return await self.check(spec, param)  # `close` cancelled the queued compile: again
            except asyncio.TimeoutError:
                result = (f"compiling the {spec.kind} spec took longer than {self.compile_timeout:g} s "
                          "(--structured-output-compile-timeout)")
            self._remember(key, result)
            entry = result
        if entry != _OK:
            raise InvalidParameterError(param, entry)

    def _remember(self, key: str, value: str | Future[str]) -> None:
        self._cache[key] = value
        self._cache.move_to_end(key)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def _compile(self, spec: StructuredOutputsParams) -> str:
        """_OK, or why the spec was refused (in a checker thread)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._factory()
        try:
            self._backend.compile(spec)
        except GrammarError as exc:
            return exc.reason
        except Exception as exc:  # noqa: BLE001 - a backend's own failure is still this spec's refusal
            return f"the {spec.kind} spec could not be compiled: {type(exc).__name__}: {exc}"
        return _OK

    def close(self) -> None:
        """Stop the threads (a later `check` starts new ones)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
