"""Build a larger English corpus for the accuracy model from Debian's documentation packages (no other download).

    apt-get download python3.11-doc perl-doc
    python bench/build_doc_corpus.py OUT.json.gz python3.11-doc_*.deb perl-doc_*.deb

Each package's text documents, one per file in path order: the reStructuredText sources of the Python
documentation (``html/_sources/**/*.rst.txt``) and Perl's POD manuals (``**/*.pod``).  About 20 MB, 15x
``data/python-docs.json.gz``; the same JSON form (``accuracy.corpus(path)`` reads it, every tenth document held out).
"""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
import tarfile

PATTERNS = (("/html/_sources/", ".rst.txt"), ("", ".pod"))


def documents(deb: str) -> list[tuple[str, str]]:
    tar = subprocess.run(["dpkg-deb", "--fsys-tarfile", deb], check=True, capture_output=True).stdout
    out = []
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        for member in t.getmembers():
            if member.isfile() and any(part in member.name and member.name.endswith(end) for part, end in PATTERNS):
                out.append((member.name, t.extractfile(member).read().decode("utf-8", "replace")))
    return sorted(out)


def main(argv: list[str]) -> int:
    out, debs = argv[0], argv[1:]
    docs = [text for deb in debs for _, text in documents(deb)]
    with gzip.GzipFile(out, "wb", mtime=0) as f:
        f.write(json.dumps({"source": "Debian packages: " + ", ".join(d.split("/")[-1] for d in debs),
                            "documents": docs}, ensure_ascii=False).encode())
    print(f"wrote {out}: {len(docs)} documents, {sum(map(len, docs))} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
