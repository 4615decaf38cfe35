"""Build the accuracy benchmark's corpus, src/kernelplan/bench/data/python-docs.json.gz, from this Python's own text.

    python bench/build_corpus.py

English prose that ships with Python (no download): the help topics of
``pydoc_data.topics`` in name order, then the docstrings longer than 80
characters (deduplicated) of the importable standard-library modules in name
order, their classes, functions and methods.  The committed file was built
with Python 3.11.7; other versions give other text.
"""

import contextlib
import gzip
import importlib
import inspect
import io
import json
import sys
import warnings
from pathlib import Path

import pydoc_data.topics

OUT = Path(__file__).resolve().parents[1] / "src" / "kernelplan" / "bench" / "data" / "python-docs.json.gz"
SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "ensurepip", "pydoc_data"}


def docstrings() -> list[str]:
    warnings.simplefilter("ignore")
    texts, seen = [], set()
    for name in sorted(sys.stdlib_module_names):
        if name in SKIP or name.startswith("_"):
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                mod = importlib.import_module(name)
        except BaseException:  # a module this platform lacks (winreg, ...)
            continue
        objs = [mod]
        for _, obj in inspect.getmembers(mod):
            if getattr(obj, "__module__", None) == name and (inspect.isclass(obj) or inspect.isfunction(obj)):
                objs.append(obj)
                if inspect.isclass(obj):
                    objs += [m for _, m in inspect.getmembers(obj, inspect.isfunction)
                             if m.__qualname__.startswith(obj.__name__ + ".")]
        for o in objs:
            d = inspect.getdoc(o)
            if d and len(d) > 80 and d not in seen:
                seen.add(d)
                texts.append(d)
    return texts


def main() -> None:
    topics = pydoc_data.topics.topics
    docs = [topics[k] for k in sorted(topics)] + docstrings()
    doc = {"source": f"Python {sys.version.split()[0]}: pydoc_data.topics (the help topics), then the docstrings (over "
                     f"80 characters, deduplicated) of the importable standard-library modules in name order, their "
                     f"classes, functions and methods (Python Software Foundation License)", "documents": docs}
    with gzip.GzipFile(OUT, "wb", mtime=0) as f:
        f.write(json.dumps(doc, ensure_ascii=False).encode())
    print(f"wrote {OUT}: {len(docs)} documents, {sum(map(len, docs))} characters")


if __name__ == "__main__":
    main()
