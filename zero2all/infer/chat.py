"""``z2all chat``: an interactive terminal chat with history, a system prompt and streamed replies.

Commands typed at the prompt::

    /reset          forget the conversation (the system prompt stays)
    /system TEXT    set a new system prompt and start over
    /exit, /quit    leave (so does Ctrl-D)

When the conversation no longer fits the model's context together with the reply budget, the oldest turns are
dropped (the system prompt is kept) and a note says so.

Ctrl-C while a reply streams stops that reply and keeps the session: the user's message and the part of the reply
already shown stay in the history (the conversation goes on from what is on the screen; ``/reset`` forgets it), a
note says so, and the prompt comes back. Ctrl-C or Ctrl-D at the prompt, or ``/exit``, leaves.
"""

from __future__ import annotations

import sys
from typing import Callable

from zero2all.infer.generate import Generator, SamplingParams

HELP = "commands: /reset, /system TEXT, /exit"


class ChatSession:
    """The conversation state: the system prompt and the turns so far, rendered with the chat template."""

    def __init__(self, generator: Generator, system: str | None = None, params: SamplingParams | None = None):
        if generator.tokenizer is None:
            raise ValueError("chat needs a tokenizer")
        self.generator = generator
        self.system = system
        self.params = params or SamplingParams(max_new_tokens=256, temperature=0.7, top_p=0.9)
        self.turns: list[dict] = []

    def messages(self, turns=None) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + (self.turns if turns is None else turns)

    def reset(self, system: str | None = None, keep_system: bool = True):
        self.turns = []
        if not keep_system:
            self.system = system

    def reply_reserve(self) -> int:
        """Context positions kept free for the reply: ``max_new_tokens``, but at most half the context, so that a
        reply budget as large as the context (256 new tokens on a 256-token model) still leaves room for a prompt;
        the reply may then use whatever the prompt leaves (``reply``)."""
        return min(self.params.max_new_tokens, self.generator.max_seq_len // 2)

    def prompt_ids(self, user_text: str) -> tuple[list[int], int]:
        """Template ids for the history + the new user message; drops the oldest turns while they do not fit.
        Returns (ids, number of turns dropped)."""
        tok = self.generator.tokenizer
        budget = self.generator.max_seq_len - self.reply_reserve()
        turns = self.turns + [{"role": "user", "content": user_text}]
        dropped = 0
        while True:
            ids = list(tok.apply_chat_template(self.messages(turns), add_generation_prompt=True))
            if len(ids) <= budget or len(turns) == 1:
                break
            turns = turns[2:]  # the oldest user + assistant pair
            dropped += 2
        if len(ids) > budget:
            raise ValueError(f"the message alone is {len(ids)} tokens; at most {budget} fit with a reply budget "
                             f"of {self.reply_reserve()}")
        self.turns = turns[:-1]
        return ids, dropped

    def reply(self, user_text: str, on_text: Callable[[str], None] | None = None) -> tuple[str, int]:
        """Generate the assistant's answer (streamed to ``on_text``), add both to the history.
        Returns (answer, turns dropped to fit)."""
        ids, dropped = self.prompt_ids(user_text)
        room = self.generator.max_seq_len - len(ids)
        params = self.params
        if params.max_new_tokens > room:
            params = SamplingParams(**{**params.__dict__, "max_new_tokens": room})
        answer = []
        try:
            for ev in self.generator.stream([ids], params):
                if ev.text:
                    if on_text:
                        on_text(ev.text)
                    answer.append(ev.text)  # after it was shown: an interrupt inside on_text drops the piece
        except KeyboardInterrupt:
            # the part already shown is what the user saw: it stays in the history, and the caller decides what
            # an interrupt means (chat_loop: a note, then the next prompt)
            self.turns += [{"role": "user", "content": user_text}, {"role": "assistant", "content": "".join(answer)}]
            raise
        text = "".join(answer)
        self.turns += [{"role": "user", "content": user_text}, {"role": "assistant", "content": text}]
        return text, dropped


def chat_loop(session: ChatSession, read: Callable[[str], str] | None = None,
              write: Callable[[str], None] = lambda s: (sys.stdout.write(s), sys.stdout.flush())) -> int:
    """Read lines until /exit, end of input or Ctrl-C at the prompt; stream each reply (Ctrl-C stops a reply, see
    the module docstring). Returns the number of replies that ran to their end."""
    read = read or input  # looked up now, not when the module was imported
    write(f"chatting ({HELP}); Ctrl-C stops a reply, Ctrl-D leaves\n")
    replies = 0
    while True:
        try:
            line = read("you> ")
        except (EOFError, KeyboardInterrupt):
            write("\n")
            return replies
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return replies
        if text == "/reset":
            session.reset()
            write("(conversation cleared)\n")
            continue
        if text.startswith("/system"):
            session.reset(text[len("/system"):].strip() or None, keep_system=False)
            write(f"(system prompt {'set' if session.system else 'cleared'}; conversation cleared)\n")
            continue
        if text.startswith("/"):
            write(f"(unknown command {text.split()[0]}; {HELP})\n")
            continue
        write("assistant> ")
        try:
            _, dropped = session.reply(line, on_text=write)
        except ValueError as e:
            write(f"\n(error: {e})\n")
            continue
        except KeyboardInterrupt:
            write("\n(reply interrupted: what was shown stays in the history; /reset forgets it)\n")
            continue
        write("\n")
        if dropped:
            write(f"(the {dropped} oldest messages were dropped to fit the context)\n")
        replies += 1
