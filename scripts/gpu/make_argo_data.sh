#!/usr/bin/env bash
# Packs what scripts/gpu/run_argo_speed.sh carries as dist/carry/argo-data.tar.xz (a few MB):
#   corpus/        the retrieval corpus (documentation of O-RAN SC repositories; its MANIFEST.txt
#                  names them and their commits), from dist/argo-data-src/corpus
#   minilm-config/ all-MiniLM-L6-v2 without its weights (scripts/fixtures/fetch_minilm.sh's
#                  folder less model.safetensors): the GPU machine makes random weights of
#                  that shape (scripts/gpu/make_random_embedder.py), builds the index with them
#                  (argo-exp ingest) and trains the bench tokenizer on the corpus and questions
#                  (scripts/gpu/make_bench_tokenizer.py)
#   oran-bench-13k/ the hard questions (fin_H.json) from ../shared/data
# Run from the repo root after building the corpus into dist/argo-data-src/corpus
# (scripts/gpu/build_argo_corpus.py, from the repositories scripts/gpu/argo_corpus_repos.txt pins).
set -euo pipefail
cd "$(dirname "$0")/../.."
SRC=dist/argo-data-src
[ -d "$SRC/corpus" ] || { echo "no $SRC/corpus: fetch the corpus first"; exit 1; }
scripts/fixtures/fetch_minilm.sh target/minilm/all-MiniLM-L6-v2
stage=$(mktemp -d)
cp -r "$SRC/corpus" "$stage/corpus"
# The manifest describes the corpus; it is not a document of it.
[ -f "$stage/corpus/MANIFEST.txt" ] && mv "$stage/corpus/MANIFEST.txt" "$stage/"
mkdir -p "$stage/minilm-config" "$stage/oran-bench-13k"
(cd target/minilm/all-MiniLM-L6-v2 && find . -type f ! -name model.safetensors ! -name README.md \
  -exec cp --parents {} "$stage/minilm-config/" \;)
cp ../shared/data/oran-bench-13k/{fin_H.json,LICENSE} "$stage/oran-bench-13k/"
mkdir -p dist/carry
tar cf - -C "$stage" . | xz -T2 -9 > dist/carry/argo-data.tar.xz
rm -rf "$stage"
ls -la dist/carry/argo-data.tar.xz
