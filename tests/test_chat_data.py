import json
import math

import pytest
import torch
import torch.nn.functional as F
from data_helpers import write_dpo_file, write_sft_file
from standin_tokenizer import ByteTokenizer, tiny_model_config

from zero2all.data.chat import (
    IGNORE_INDEX,
    ChatDataError,
    collate,
    dpo_collate,
    load_dpo_samples,
    load_sft_samples,
    pack_samples,
    pad_samples,
    render_dpo_record,
    render_sft_record,
)
from zero2all.model.z2all import build_model
from zero2all.train.dpo import dpo_loss, sequence_logprobs

TOK = ByteTokenizer()


def labelled_text(sample):
    """The labelled tokens, decoded with a '|' between separate labelled runs."""
    runs, cur = [], []
    for t, y in zip(sample.input_ids, sample.labels):
        if y != IGNORE_INDEX:
            assert y == t
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return "|".join(TOK.decode(r) for r in runs)


def test_conversation_labels_cover_only_assistant_turns():
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}]
    s = render_sft_record(TOK, {"conversations": conv}, "x.jsonl:1")
    assert s.input_ids == TOK.apply_chat_template(conv)
    assert labelled_text(s) == "hello<|im_end|>|4<|im_end|>"
    assert s.num_label_tokens == len("hello") + 1 + len("4") + 1


def test_instruction_labels_cover_only_the_output():
    s = render_sft_record(TOK, {"instruction": "Add", "input": "2 and 3", "output": "5"})
    expected = TOK.apply_chat_template([{"role": "user", "content": "Add\n\n2 and 3"},
                                        {"role": "assistant", "content": "5"}])
    assert s.input_ids == expected
    assert labelled_text(s) == "5<|im_end|>"
    s2 = render_sft_record(TOK, {"instruction": "Say hi", "output": "hi", "system": "sys"})
    assert TOK.decode(s2.input_ids).startswith("<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nSay hi<|im_end|>")
    assert labelled_text(s2) == "hi<|im_end|>"


@pytest.mark.parametrize("record, message", [
    ({"conversations": [{"role": "bot", "content": "x"}]}, "role 'bot'"),
    ({"conversations": [{"role": "user", "content": "x"}]}, "no assistant"),
    ({"instruction": "x"}, "'output'"),
    ({"text": "x"}, "expected 'conversations'"),
    ({"conversations": [{"role": "user", "content": 3}]}, "content must be a string"),
])
def test_bad_records_name_the_place(record, message):
    with pytest.raises(ChatDataError, match=message) as e:
        render_sft_record(TOK, record, "data.jsonl:7")
    assert str(e.value).startswith("data.jsonl:7:")


def test_load_reports_file_line_or_counts_skips(tmp_path):
    f = tmp_path / "sft.jsonl"
    good = {"instruction": "a", "output": "b"}
    f.write_text("\n".join([json.dumps(good), "{not json", json.dumps({"instruction": "x"}), "",
                            json.dumps(good)]) + "\n")
    with pytest.raises(ChatDataError, match=r"sft.jsonl:2: invalid JSON"):
        load_sft_samples(f, TOK)
    samples, stats = load_sft_samples(f, TOK, on_error="skip")
    assert len(samples) == 2 and stats.records == 4 and stats.skipped == 2
    assert "sft.jsonl:3" in stats.errors[1]
    # truncation below the first label drops the sample (counted)
    samples, stats = load_sft_samples(f, TOK, max_len=5, on_error="skip")
    assert samples == [] and stats.truncated == 2 and stats.dropped_no_labels == 2


def random_samples(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        conv = [{"role": "user", "content": "q" * int(torch.randint(1, 9, (1,), generator=g))},
                {"role": "assistant", "content": "a" * int(torch.randint(1, 13, (1,), generator=g))}]
        if i % 2:
            conv += [{"role": "user", "content": "more"}, {"role": "assistant", "content": "z" * (i + 1)}]
        out.append(render_sft_record(TOK, {"conversations": conv}))
    return out


def test_packed_loss_equals_unpacked_loss():
    model = build_model(tiny_model_config(initializer_range=0.3), seed=1).eval()
    samples = random_samples(7, seed=3)
    rows = pack_samples(samples, seq_len=96, pad_id=TOK.pad_id)
    assert len(rows) < len(samples)  # several samples share a row
    batch = collate(rows)
    with torch.no_grad():
        _, packed = model(batch["input_ids"], batch["labels"], doc_ids=batch["doc_ids"],
                          position_ids=batch["position_ids"])
        total, count = 0.0, 0
        for s in samples:  # each sample alone, no padding at all
            logits, _ = model(torch.tensor([s.input_ids[:-1]]))
            y = torch.tensor(s.labels[1:])
            total += F.cross_entropy(logits[0].double(), y, ignore_index=IGNORE_INDEX, reduction="sum").item()
            count += int((y != IGNORE_INDEX).sum())
        padded = collate(pad_samples(samples, None, TOK.pad_id))
        _, padded_loss = model(padded["input_ids"], padded["labels"])
    assert packed.item() == pytest.approx(total / count, rel=1e-5)
    assert padded_loss.item() == pytest.approx(total / count, rel=1e-5)


def test_packing_without_document_ids_differs():
    """The check above is not vacuous: without doc_ids, samples attend to each other and the loss changes.
    (Positions restarting at 0 matter less: RoPE scores depend only on position differences, so a constant shift
    per sample changes them only by rounding, and by the base under dynamic NTK scaling.)"""
    model = build_model(tiny_model_config(initializer_range=0.3), seed=1).eval()
    batch = collate(pack_samples(random_samples(7, seed=3), seq_len=96, pad_id=TOK.pad_id))
    with torch.no_grad():
        _, right = model(batch["input_ids"], batch["labels"], doc_ids=batch["doc_ids"],
                         position_ids=batch["position_ids"])
        _, no_docs = model(batch["input_ids"], batch["labels"], position_ids=batch["position_ids"])
        _, zero_pos = model(batch["input_ids"], batch["labels"], doc_ids=batch["doc_ids"],
                            position_ids=torch.zeros_like(batch["position_ids"]))
    assert abs(right.item() - no_docs.item()) > 1e-4
    assert abs(right.item() - zero_pos.item()) > 1e-4  # the positions given are the ones used


def test_pack_rows_layout():
    samples = random_samples(5, seed=0)
    rows = pack_samples(samples, seq_len=64, pad_id=TOK.pad_id)
    n_tokens = sum(len(s.input_ids) - 1 for s in samples)
    assert sum(int((r["doc_ids"] < r["doc_ids"].max()).sum()) for r in rows) <= n_tokens
    for r in rows:
        starts = torch.nonzero(r["position_ids"] == 0).flatten().tolist()
        changes = [0] + (torch.nonzero(r["doc_ids"][1:] != r["doc_ids"][:-1]).flatten() + 1).tolist()
        assert starts == changes
    with pytest.raises(ValueError, match="do not fit"):
        pack_samples(samples, seq_len=8, pad_id=0)


def test_dpo_records_render_prompt_unlabelled(tmp_path):
    pair = render_dpo_record(TOK, {"prompt": "2+2?", "chosen": "4", "rejected": "5"})
    assert labelled_text(pair.chosen) == "4<|im_end|>" and labelled_text(pair.rejected) == "5<|im_end|>"
    prompt_len = len(TOK.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True))
    assert pair.chosen.input_ids[:prompt_len] == pair.rejected.input_ids[:prompt_len]
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"},
            {"role": "user", "content": "name?"}]
    pair = render_dpo_record(TOK, {"conversations": conv, "chosen": {"role": "assistant", "content": "Zed"},
                                   "rejected": "no"})
    assert labelled_text(pair.chosen) == "Zed<|im_end|>"  # earlier assistant turns are context only
    f = tmp_path / "dpo.jsonl"
    f.write_text(json.dumps({"prompt": "p", "chosen": "a"}) + "\n")
    with pytest.raises(ChatDataError, match=r"dpo.jsonl:1: preference record needs 'rejected'"):
        load_dpo_samples(f, TOK)
    f.write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "bb"}) + "\n")
    pairs, _ = load_dpo_samples(f, TOK)
    batch = dpo_collate(pairs, TOK.pad_id)
    assert batch["chosen_ids"].shape == batch["rejected_ids"].shape and batch["chosen_ids"].shape[0] == 1
    assert (batch["chosen_labels"][0] != -100).sum() == 2 and (batch["rejected_labels"][0] != -100).sum() == 3


def test_sequence_logprobs_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0], [1.0, 1.0]]])   # p = (1/4, 3/4), (1/2, 1/2)
    labels = torch.tensor([[1, 0, -100]])
    assert sequence_logprobs(logits, labels).item() == pytest.approx(math.log(0.75) + math.log(0.5), rel=1e-6)


def test_dpo_loss_by_hand():
    pc, pr = torch.tensor([-1.0, -5.0]), torch.tensor([-3.0, -4.0])
    rc, rr = torch.tensor([-2.0, -4.0]), torch.tensor([-2.0, -4.5])
    loss, m = dpo_loss(pc, pr, rc, rr, beta=0.1)
    # margins: 0.1*((-1+2)-(-3+2)) = 0.2 and 0.1*((-5+4)-(-4+4.5)) = -0.15
    expected = (math.log(1 + math.exp(-0.2)) + math.log(1 + math.exp(0.15))) / 2   # 0.598139, 0.770957
    assert loss.item() == pytest.approx(expected, rel=1e-6) == pytest.approx(0.684548, abs=1e-6)
    assert m["rewards/accuracy"] == 0.5 and m["rewards/margin"] == pytest.approx(0.025, abs=1e-7)
    assert m["rewards/chosen"] == pytest.approx((0.1 - 0.1) / 2, abs=1e-7)
    # gradient wrt the policy's chosen log-prob: -beta * sigmoid(-margin) / B
    pc.requires_grad_(True)
    dpo_loss(pc, pr, rc, rr, beta=0.1)[0].backward()
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert pc.grad.tolist() == pytest.approx([-0.1 * sig(-0.2) / 2, -0.1 * sig(0.15) / 2], rel=1e-6)


def test_labels_with_a_trained_tokenizer(tmp_path):
    """With a real BPE tokenizer the rendering equals its chat template and labels decode to the answers."""
    from zero2all.tokenizer import train_tokenizer

    corpus = tmp_path / "c.txt"
    corpus.write_text(open(__file__).read())
    tok = train_tokenizer([str(corpus)], vocab_size=400, out_dir=tmp_path / "tok")
    conv = [{"role": "user", "content": "What is labelled?"}, {"role": "assistant", "content": "Only answers."},
            {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "def f(x): return x"}]
    s = render_sft_record(tok, {"conversations": conv})
    assert s.input_ids == tok.apply_chat_template(conv)
    runs, cur = [], []
    for t, y in zip(s.input_ids, s.labels):
        if y != IGNORE_INDEX:
            cur.append(y)
        elif cur:
            runs, cur = runs + [cur], []
    assert [tok.decode(r) for r in runs] == ["Only answers.<|im_end|>", "def f(x): return x<|im_end|>"]


def test_docstring_instruction_set(tmp_path):
    from zero2all.data.instructions import build_docstring_instructions, docstring_records, write_jsonl

    src = '''
def add(a, b=2, *rest):
    """Return the sum of a and b, plus the rest."""

def _hidden():
    """A private helper is not asked about."""

class Box:
    """A box that holds one value at a time."""
    def put(self, value):
        """Store value in the box, replacing the old one."""
'''
    recs = docstring_records(src, "demo")
    assert recs == [
        {"instruction": "Write the docstring of the function `add(a, b=2, *rest)` in module `demo`.",
         "output": "Return the sum of a and b, plus the rest."},
        {"instruction": "Write the docstring of the class `Box` in module `demo`.",
         "output": "A box that holds one value at a time."},
        {"instruction": "Write the docstring of the method `Box.put(self, value)` in module `demo`.",
         "output": "Store value in the box, replacing the old one."}]
    bad = tmp_path / "bad.py"
    bad.write_text("def broken(:\n")
    good = tmp_path / "good.py"
    good.write_text(src)
    records, stats = build_docstring_instructions([bad, good], seed=1)
    assert stats.files == 2 and stats.unparsable == 1 and len(records) == 3
    out = write_jsonl(records, tmp_path / "sft.jsonl")
    samples, load_stats = load_sft_samples(out, TOK)
    assert len(samples) == 3 and load_stats.skipped == 0
    stdlib, stats = build_docstring_instructions(max_records=50)
    assert len(stdlib) == 50 and stats.files > 100 and stats.records == 50
    assert all(r["instruction"].startswith("Write the docstring of the ") and r["output"] for r in stdlib)


def test_reference_logprobs_precomputed_equal_direct_and_zero_loss_at_start():
    from zero2all.train.dpo import pair_logprobs, precompute_reference_logprobs

    model = build_model(tiny_model_config(initializer_range=0.3), seed=2).eval()
    records = [{"prompt": "q" * (i + 1), "chosen": "yes" * (i % 3 + 1), "rejected": "no"} for i in range(5)]
    pairs = [render_dpo_record(TOK, r) for r in records]
    ref = precompute_reference_logprobs(model, pairs, TOK.pad_id, batch_size=2)
    for i, p in enumerate(pairs):  # each sequence alone, no padding
        for j, s in enumerate((p.chosen, p.rejected)):
            logits, _ = model(torch.tensor([s.input_ids[:-1]]))
            direct = sequence_logprobs(logits, torch.tensor([s.labels[1:]]))
            assert ref[i, j].item() == pytest.approx(direct.item(), rel=1e-5)
    # the policy equal to the reference: rewards 0, loss log 2
    chosen, rejected = pair_logprobs(model, dpo_collate(pairs, TOK.pad_id))
    loss, m = dpo_loss(chosen, rejected, ref[:, 0], ref[:, 1], beta=0.5)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-5) and abs(m["rewards/margin"]) < 1e-5


def test_sft_and_dpo_datasets_iterate_resumably(tmp_path):
    from zero2all.data.chat import DPODataset, SFTDataset

    f = write_sft_file(tmp_path / "sft.jsonl", 40, trailing="{broken\n")
    ds = SFTDataset.from_files(f, TOK, seq_len=48, mode="pack", on_error="skip")
    assert ds.stats.skipped == 1 and len(ds) > 2
    it = ds.iterator(3, seed=5)
    batches = [next(it) for _ in range(7)]                      # crosses an epoch boundary
    assert set(batches[0]) == {"input_ids", "labels", "doc_ids", "position_ids"}
    assert batches[0]["input_ids"].shape == (3, 48)
    resumed = ds.iterator(3, seed=5)
    replay = ds.iterator(3, seed=5)
    for _ in range(4):
        next(replay)
    resumed.load_state_dict(replay.state_dict())
    for b in batches[4:]:
        nxt = next(resumed)
        assert all(torch.equal(nxt[k], b[k]) for k in b)
    with pytest.raises(ValueError, match="batch_size"):
        ds.iterator(4, seed=5).load_state_dict(replay.state_dict())
    # ranks get disjoint rows, equally many
    r0, r1 = (SFTDataset.from_files(f, TOK, 48, "pad", "skip", rank=r, world_size=2) for r in (0, 1))
    assert len(r0) == len(r1) == 20 and not torch.equal(r0[0]["input_ids"], r1[0]["input_ids"])
    g = write_dpo_file(tmp_path / "dpo.jsonl", 5)
    b = next(DPODataset.from_files(g, TOK, seq_len=40).iterator(2, seed=0))
    assert b["chosen_ids"].shape == b["rejected_ids"].shape == (2, 40)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
TOOL_CONV = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function",
                  "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
             {"role": "assistant", "content": "21 degrees."}]


def test_tool_turns_render_and_only_assistant_turns_learn(tmp_path):
    """A conversation with tools: the tools in the system turn, the tool-call turn learned as assistant output
    (its blocks and <|im_end|>), the tool's result not; the same with a trained tokenizer."""
    from zero2all.data.tools import parse_tool_calls
    from zero2all.tokenizer import train_tokenizer

    corpus = tmp_path / "c.txt"
    corpus.write_text(open(__file__).read())
    real = train_tokenizer([str(corpus)], vocab_size=400, out_dir=tmp_path / "tok")
    for tok in (TOK, real):
        s = render_sft_record(tok, {"conversations": TOOL_CONV, "tools": TOOLS})
        text = tok.decode(s.input_ids)
        assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "get_weather"' in text
        assert "<|im_start|>tool\n{\"temp\": 21}<|im_end|>" in text
        runs, cur = [], []
        for y in s.labels:
            if y != IGNORE_INDEX:
                cur.append(y)
            elif cur:
                runs, cur = runs + [cur], []
        learned = [tok.decode(r) for r in runs]
        call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        assert learned == [call + "<|im_end|>", "21 degrees.<|im_end|>"]
        assert parse_tool_calls(call) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("conv, message", [
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "bad name"}}]}],
     r"conversations\[1\]\.tool_calls\[0\]"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}], "not valid JSON"),
    ([{"role": "assistant", "tool_calls": {"function": {}}}], "must be a list"),
])
def test_bad_tool_records_name_the_place(conv, message):
    with pytest.raises(ChatDataError, match=message):
        render_sft_record(TOK, {"conversations": [{"role": "user", "content": "x"}] + conv})


def test_prepare_sft_takes_tool_records(tmp_path):
    """prepare-sft renders tool-calling conversations: the stored labels are those of render_sft_record."""
    from zero2all.data.sft_shards import SFTShardDataset, prepare_sft
    from zero2all.tokenizer import train_tokenizer

    corpus = tmp_path / "c.txt"
    corpus.write_text(open(__file__).read())
    tok = train_tokenizer([str(corpus)], vocab_size=400, out_dir=tmp_path / "tok")
    records = tmp_path / "tools.jsonl"
    records.write_text(json.dumps({"conversations": TOOL_CONV, "tools": TOOLS}) + "\n")
    prepare_sft([records], tmp_path / "tok", tmp_path / "shards", log=lambda *a: None)
    ds = SFTShardDataset(tmp_path / "shards", 512, tok.pad_id, "pad")
    expected = render_sft_record(tok, {"conversations": TOOL_CONV, "tools": TOOLS})
    assert ds.tokens.tolist() == expected.input_ids
    assert ds.labels.tolist() == [int(y != IGNORE_INDEX) for y in expected.labels]   # 1: learned
