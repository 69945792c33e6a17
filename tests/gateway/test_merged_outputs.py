"""`_merged_outputs`: the deltas of a request of several prompts, merged across them.

Each prompt's reader runs ahead of the consumer (it folds a whole batch of entries into its
prompt's `OutputLog` before the consumer takes the first of them): whether a prompt ended must
be read as of each item, not from the log when the consumer gets to it."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from pagedserve.common.output_log import OutputLog
from pagedserve.common.outputs import CompletionDelta
from pagedserve.common.queue_protocol import Chunk, QueuedRequest
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.gateway.responses import ResponseBuilder
from pagedserve.gateway.streaming import _merged_outputs


class _BatchedQueue:
    """Hands each prompt's whole output (6 one-token chunks, the last one final) over at once,
    as the shared reader does when one XREAD found them all; prompt 1's only once prompt 0's
    reader is through."""

    def __init__(self):
        self.first_through = asyncio.Event()

    async def outputs(self, request_id, n, deadline, give_up):
        prompt = int(request_id.rsplit("-", 1)[1])
        if prompt == 1:
            await self.first_through.wait()
        log = OutputLog(n)
        for k in range(6):
            chunk = Chunk(attempt=1, deltas=[CompletionDelta(index=0, start=k, token_ids=[10 * prompt + k],
                                                              text=f"{prompt}{k} ", finish_reason="length" if k == 5 else None)],
                          done=k == 5)
            yield log.apply(chunk), log  # no await between: the whole batch is folded in one go
        self.first_through.set()


def test_every_delta_of_every_prompt_arrives_when_a_reader_runs_ahead():
    params = SamplingParams(max_tokens=6)
    queued = [QueuedRequest(request_id=f"r-{i}", prompt_token_ids=[1], params=params, deadline=time.time() + 60)
              for i in range(2)]
    state = SimpleNamespace(queue=_BatchedQueue(), drain_deadline=None)

    async def collect() -> tuple[dict[int, str], list[tuple[int, bool]], list[bool]]:
        texts, lasts, all_done = {0: "", 1: ""}, [], []
        builder = ResponseBuilder("completion", "m", 1, 2, False, None)
        async for i, deltas, log, last in _merged_outputs(state, queued):  # type: ignore[arg-type]
            texts[i] += "".join(d.text for d in deltas)
            lasts.append((i, last))
            builder.add(i, deltas, log, last)
            all_done.append(builder.all_done())
        return texts, lasts, all_done

    texts, lasts, all_done = asyncio.run(asyncio.wait_for(collect(), 10))
    assert texts == {0: "00 01 02 03 04 05 ", 1: "10 11 12 13 14 15 "}
    assert lasts == [(0, k == 5) for k in range(6)] + [(1, k == 5) for k in range(6)]
    assert all_done == [False] * 11 + [True]  # a stream reads on until the last prompt's last item
