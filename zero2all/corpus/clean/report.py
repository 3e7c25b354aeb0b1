"""``report.json``, ``report.md`` and ``report.png`` of a cleaning run."""

from __future__ import annotations

from pathlib import Path

from zero2all.fileio import atomic_write, save_json

__all__ = ["render_markdown", "summary_line", "write_report"]


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f}"


def summary_line(report: dict) -> str:
    t = report["totals"]
    rm = ", ".join(f"{k}={v:,}" for k, v in sorted(report["removed"].items(), key=lambda kv: -kv[1])) or "none"
    return (f"kept {t['docs_out']:,} of {t['docs_in']:,} documents ({_mb(t['bytes_out'])} of {_mb(t['bytes_in'])} MB); "
            f"removed: {rm}")


def render_markdown(report: dict) -> str:
    d = report["dedup"]
    lines = ["# Cleaning report", "", f"inputs: {', '.join(report.get('inputs', []))}", "",
             summary_line(report), "",
             f"near dedup: threshold {d['threshold']}, {d['num_perm']} permutations, {d['bands']} bands x "
             f"{d['rows']} rows; S-curve {d['curve_at_threshold']} at the threshold, {d['curve_at_0.5']} at 0.5; "
             f"verify bar {d['verify_bar']}; {d.get('candidate_pairs', 0):,} candidate pairs, "
             f"{d.get('verified_pairs', 0):,} verified; {d.get('exact_clusters', 0):,} exact and "
             f"{d.get('near_clusters', 0):,} near duplicate clusters", ""]
    if "seconds" in report:
        s = report["seconds"]
        lines += [f"time: {s['total']} s ({s['stage1_filter_hash']} s filters + hashing, {s['stage2_dedup']} s "
                  f"dedup) with {report.get('workers')} workers", ""]
    lines += ["| source | docs in | docs out | MB in | MB out | duplicate clusters | PII masked |",
              "|---|---:|---:|---:|---:|---:|---|"]
    for name, s in report["sources"].items():
        pii = ", ".join(f"{k} {v}" for k, v in sorted(s["pii"].items())) or "-"
        lines.append(f"| {name} | {s['docs_in']:,} | {s['docs_out']:,} | {_mb(s['bytes_in'])} | "
                     f"{_mb(s['bytes_out'])} | {s['duplicate_clusters']:,} | {pii} |")
    rules = sorted(report["removed"], key=lambda k: -report["removed"][k])
    if rules:
        names = list(report["sources"])
        lines += ["", "Removals per rule:", "", "| rule | " + " | ".join(names) + " | total |",
                  "|---|" + "---:|" * (len(names) + 1)]
        for r in rules:
            lines.append(f"| {r} | " + " | ".join(f"{report['sources'][n]['removed'].get(r, 0):,}" for n in names)
                         + f" | {report['removed'][r]:,} |")
    dc = report.get("decontamination")
    if dc:
        verb = "removed" if dc["mode"] == "remove" else "flagged and kept (report only)"
        lines += ["", f"Decontamination: {dc['documents']:,} documents sharing a {dc['ngram']}-word n-gram with an "
                      f"evaluation set, {verb}:", "", "| evaluation set | texts | n-grams | documents |",
                  "|---|---:|---:|---:|"]
        for st in dc["sets"]:
            lines.append(f"| {st['name']} | {st['texts']:,} | {st['ngrams']:,} | {st['docs']:,} |")
        for st in dc["sets"]:
            for e in st["examples"]:
                snippet = e["text"].replace("\n", " ")[:120].replace("|", "\\|")
                lines.append(f"- {st['name']}: `{e['id']}` [{e['data_src']}] shares \"{e['ngram']}\": {snippet}")
    if report.get("sampling"):
        lines += ["", "Temperature sampling over the cleaned sources (weights for `z2all prepare`, same total size):",
                  ""]
        for t, weights in report["sampling"].items():
            flags = " ".join(f"--source {k}={v:g}" for k, v in weights.items())
            lines.append(f"- T = {t}: `{flags}`")
    bad = report["read"]["bad"]
    lines += ["", "Bad input skipped: " + (", ".join(f"{k}={v}" for k, v in sorted(bad.items())) or "none")]
    lines += [f"  {e}" for e in report["read"]["examples"]]
    if report["examples"]:
        lines += ["", "## Examples of removed documents", ""]
        for rule, exs in report["examples"].items():
            if not exs:
                continue
            lines.append(f"### {rule}")
            for e in exs:
                kept = f" (duplicate of {e['kept_id']})" if "kept_id" in e else ""
                snippet = e["text"].replace("\n", " ")[:120].replace("|", "\\|")
                lines.append(f"- `{e['id']}` [{e['data_src']}]{kept}: {snippet}")
            lines.append("")
    return "\n".join(lines) + "\n"


def _chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rules = sorted(report["removed"], key=lambda k: report["removed"][k])
    names = list(report["sources"])
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.35 * max(len(rules), 1)))
    left = [0] * len(rules)
    for name in names:
        vals = [report["sources"][name]["removed"].get(r, 0) for r in rules]
        ax.barh(rules, vals, left=left, label=name)
        left = [a + b for a, b in zip(left, vals)]
    t = report["totals"]
    ax.set_xlabel("documents removed")
    ax.set_title(f"kept {t['docs_out']:,} of {t['docs_in']:,} documents")
    if len(names) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def write_report(report: dict, out_dir: str | Path) -> None:
    out_dir = Path(out_dir)
    save_json(report, out_dir / "report.json")
    with atomic_write(out_dir / "report.md") as f:
        f.write(render_markdown(report))
    _chart(report, out_dir / "report.png")
