"""Host time per streamed token on the server's side: a request's events through ``InferenceApp.chunks`` (the
OpenAI chunk of each token, the request's metrics) and their server-sent-event encoding, as ``z2all serve`` writes
them, without a model, a scheduler or a socket.

    python benchmarks/stream_host_cost.py [--tokens 20000] [--repeats 7] [--tokenizer DIR]

Prints microseconds per token, min / median / max over the repeats, for completions and chat completions. Every
streamed token of every client costs this on the server's event loop (beside the write itself), in the same process
as the scheduler's thread: at 256 clients, 256 times per decode step.

With ``--tokenizer DIR`` (a tokenizer directory, e.g. a checkpoint's): also the scheduler thread's part, a row's
incremental detokenisation per token (``_RowText.add``, over 4,000 tokens of this project's source), decoding a
window of the last 32 or 8 tokens each step, and token by token through the tokenizer's bytes where it allows.
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
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory: also time the row detokenisation")
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
    if args.tokenizer:
        detokenise(args.tokenizer, args.repeats)
    return 0


def detokenise(path: str, repeats: int):
    from pathlib import Path

    import zero2all
    from zero2all.infer.generate import _RowText
    from zero2all.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    ids = tok.encode((Path(zero2all.__file__).parent / "infer" / "scheduler.py").read_text())[:4000]
    want = tok.decode(ids, skip_special=True)
    table = tok.byte_decoding()
    for name, window, by_bytes in (("window of 32", 32, False), ("window of 8", 8, False), ("bytes", 8, True)):
        if by_bytes and table is None:
            print("row text, bytes: this tokenizer's decoding is not byte concatenation")
            continue
        times = []
        for _ in range(repeats + 1):
            row = _RowText(tok, [])
            row.WINDOW = window
            if not by_bytes:
                row._bytes = row._utf8 = None
            t0 = time.perf_counter()
            pieces = [row.add(i)[0] for i in ids]
            pieces.append(row.finish())
            times.append(1e6 * (time.perf_counter() - t0) / len(ids))
            assert "".join(pieces) == want
        times = times[1:]
        print(f"row text, {name}: {min(times):.2f} / {statistics.median(times):.2f} / {max(times):.2f} us per "
              f"token (min / median / max of {repeats})")


if __name__ == "__main__":
    raise SystemExit(main())
