#!/usr/bin/env python3
"""The retrieval corpus of the ARGO speed run: the documentation of O-RAN Software Community
repositories at pinned commits (scripts/gpu/argo_corpus_repos.txt: `owner/name sha` per line).

    python3 scripts/gpu/build_argo_corpus.py --repos DIR --out dist/argo-data-src/corpus

DIR holds a git repository per line of the list, cloned or bare, as DIR/<name> (or
DIR/<owner>+<name>/repo, the layout of a mirror). Nothing is checked out: the files are read at
the pinned commit with `git show`. A document is a top-level README*, or a .rst/.md/.txt file
(or README*) under a docs/ or doc/ folder; left out are licence files, pip requirement lists,
CMakeLists.txt, Sphinx _static/_build folders, binary or non-UTF-8 files, and files that say
"this document is generated" (RMR's man pages are generated from its doc/src). Writes the files
under OUT/<name>/<path> and OUT/MANIFEST.txt (`owner/name sha files bytes`, then a total), and
prints what it dropped. scripts/gpu/make_argo_data.sh packs the result.
"""
import argparse
import os
import re
import subprocess
from pathlib import Path


def git(gitdir: Path, *args: str) -> bytes:
    return subprocess.run(["git", f"--git-dir={gitdir}", *args], capture_output=True,
                          check=True).stdout


def find_gitdir(repos: Path, owner: str, name: str) -> Path:
    for cand in (repos / name / ".git", repos / name, repos / f"{owner}+{name}" / "repo"):
        if (cand / "HEAD").exists():
            return cand
    raise SystemExit(f"no git repository for {owner}/{name} under {repos}")


def is_document(path: str) -> bool:
    parts = path.split("/")
    base = parts[-1]
    top_readme = len(parts) == 1 and base.startswith("README")
    in_docs = any(p in ("docs", "doc") for p in parts[:-1])
    doc_ext = re.search(r"\.(rst|md|txt)$", base.lower()) or base.startswith("README")
    return bool(top_readme or (in_docs and doc_ext))


def left_out(path: str) -> bool:
    parts = path.split("/")
    bl = parts[-1].lower()
    return ("licen" in bl or (bl.startswith("requirements") and bl.endswith(".txt"))
            or bl == "cmakelists.txt" or "_static" in parts or "_build" in parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repos", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--list", type=Path, default=Path(__file__).with_name("argo_corpus_repos.txt"))
    a = ap.parse_args()
    rows, dropped = [], []
    for line in a.list.read_text().splitlines():
        if not line.strip():
            continue
        full, sha = line.split()
        owner, name = full.split("/")
        g = find_gitdir(a.repos, owner, name)
        n = size = 0
        names = git(g, "ls-tree", "-r", "--name-only", "-z", sha).decode().split("\0")
        for p in filter(None, names):
            if not is_document(p):
                continue
            if left_out(p):
                dropped.append((name, p, "filter"))
                continue
            data = git(g, "show", f"{sha}:{p}")
            if b"\0" in data:
                dropped.append((name, p, "binary"))
                continue
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                dropped.append((name, p, "non-utf8"))
                continue
            if re.search(rb"this document is generated", data[:3000], re.I):
                dropped.append((name, p, "generated"))
                continue
            dst = a.out / name / p
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
            n, size = n + 1, size + len(data)
        rows.append((full, sha, n, size))
    a.out.mkdir(parents=True, exist_ok=True)
    with open(a.out / "MANIFEST.txt", "w") as f:
        for r in rows:
            f.write("%s %s %d %d\n" % r)
        f.write("TOTAL %d repositories %d files %d bytes\n"
                % (len(rows), sum(r[2] for r in rows), sum(r[3] for r in rows)))
    for d in dropped:
        print("dropped", *d)


if __name__ == "__main__":
    main()
