"""MkDocs hook: the repository's BENCHMARKS.md (the full record, beside the README) becomes the page
``benchmarks-full.md`` of the site, so the docs link to one file instead of a copy that could drift."""

from pathlib import Path

from mkdocs.structure.files import File


def on_files(files, config):
    source = Path(config.config_file_path).parent / "BENCHMARKS.md"
    files.append(File.generated(config, "benchmarks-full.md", content=source.read_text(encoding="utf-8")))
    return files
