"""Host time per streamed token on the server's side: a request's events through ``InferenceApp.chunks`` (the
OpenAI chunk of each token, the request's metrics) and their server-sent-event encoding, as ``z2all serve`` writes
them, without a model, a scheduler or a socket.

    python benchmarks/stream_host_cost.py [--tokens 20000] [--repeats 7]

Prints microseconds per token, min / median / max over the repeats, for completions and chat completions. Every
streamed token of every client costs this on the server's event loop (beside the write itself), in the same process
as the scheduler's thread: at 256 clients, 256 times per decode step.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)

    from zero2all.infer import server as S
    from zero2all.infer.generate import GenerationEvent

    class Events:  # a submission whose events are all ready: one token per batch, as a stream that keeps up
        def __init__(self, n):
            self.n = n

        async def abatches(self):
            for i in range(self.n - 1):
                yield [GenerationEvent(0, 100 + i % 50, " tok")]
            yield [GenerationEvent(0, 7, " end", "length")]

    app = S.InferenceApp.__new__(S.InferenceApp)  # the response side only
    app.metrics, app.model_name = S.ServerMetrics(), "z2all-1.1b"

    async def stream(chat: bool) -> int:
        job = S._Job(chat, "cmpl-0", [[1, 2]], Events(args.tokens), True, False, time.monotonic())
        size = 0
        async for out in app.chunks(job):
            size += len(S._sse(out))
        return size

    for chat in (False, True):
        times = []
        for _ in range(args.repeats + 1):
            t0 = time.perf_counter()
            asyncio.run(stream(chat))
            times.append(1e6 * (time.perf_counter() - t0) / args.tokens)
        times = times[1:]  # the first is a warm-up
        print(f"{'chat completions' if chat else 'completions'}: {min(times):.2f} / {statistics.median(times):.2f} "
              f"/ {max(times):.2f} us per token (min / median / max of {args.repeats})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
