//! An embedded vector index on disk: document chunks, their embeddings, and exact cosine top-k.
//!
//! Layout of an index directory:
//!
//! - `index.json` — format version, the embedder's identity ([`EmbedderId`]), chunking
//!   settings, and the files ingested (path, size, content hash, chunk count);
//! - `chunks.jsonl` — one chunk per line: `{id, source, text}`;
//! - `embeddings.f32` — `n x dim` little-endian f32, row `i` = chunk `i`.
//!
//! Every write goes to temporary files renamed into place, so a killed ingest leaves the old
//! index intact. Searching with another embedder than the one that built the index is an
//! error, not silently wrong scores.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use fleet_models::embedder::{EmbedderId, SentenceEmbedder};
use serde::{Deserialize, Serialize};

/// Version of the on-disk layout.
pub const INDEX_FORMAT: u32 = 1;

/// Errors of the index.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    /// A file could not be read or written.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The index directory is not a valid index.
    #[error("index {path}: {message}")]
    Corrupt {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong and what to do.
        message: String,
    },
    /// Ingest asked for other chunking than the index was built with.
    #[error("index {path} was built with chunks of {built_words} words ({built_overlap} overlap), not {asked_words} ({asked_overlap}): run `argo-exp ingest --rebuild` to re-chunk every document, or leave out --chunk-words/--chunk-overlap")]
    ChunkingMismatch {
        /// The index directory.
        path: PathBuf,
        /// Words per chunk in the index.
        built_words: usize,
        /// Overlap in the index.
        built_overlap: usize,
        /// Words per chunk asked for.
        asked_words: usize,
        /// Overlap asked for.
        asked_overlap: usize,
    },
    /// The index was built with another embedder.
    #[error("index {path} was built with another embedder ({message}): use the embedder that built it, or rebuild the index with `argo-exp ingest --rebuild`")]
    EmbedderMismatch {
        /// The index directory.
        path: PathBuf,
        /// Which fields differ.
        message: String,
    },
    /// Nothing to ingest, or an empty index searched.
    #[error("{0}")]
    Empty(String),
    /// The embedder or a tensor operation failed.
    #[error(transparent)]
    Model(#[from] fleet_models::ModelError),
    /// A tensor operation failed.
    #[error("tensor error: {0}")]
    Tensor(#[from] candle_core::Error),
}

/// How documents are cut into chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunking {
    /// Words per chunk at most.
    pub words: usize,
    /// Words shared by consecutive chunks of a paragraph run.
    pub overlap: usize,
}

impl Default for Chunking {
    /// 160 words with 32 of overlap: about 220 word pieces, inside all-MiniLM-L6-v2's 256.
    fn default() -> Self {
        Chunking {
            words: 160,
            overlap: 32,
        }
    }
}

/// One piece of a document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Chunk {
    /// Position in the index (row of the embedding matrix).
    pub id: u64,
    /// The file it came from, relative to the ingested directory.
    pub source: String,
    /// The text.
    pub text: String,
}

/// A file that has been ingested.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IndexedFile {
    /// Path relative to the ingested directory.
    pub path: String,
    /// Size in bytes.
    pub bytes: u64,
    /// FNV-1a 64 of the content, to tell changed files.
    pub hash: String,
    /// Chunks it gave.
    pub chunks: usize,
}

/// `index.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IndexMeta {
    /// [`INDEX_FORMAT`].
    pub format: u32,
    /// The embedder that made the embeddings.
    pub embedder: EmbedderId,
    /// Embedding width.
    pub dim: usize,
    /// Chunking settings.
    pub chunking: Chunking,
    /// Files ingested, in order.
    pub files: Vec<IndexedFile>,
}

/// A search hit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hit {
    /// The chunk's id.
    pub id: u64,
    /// Cosine similarity.
    pub score: f32,
}

/// What an ingest did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct IngestReport {
    /// Files added.
    pub added: Vec<String>,
    /// Files already in the index with the same content.
    pub unchanged: Vec<String>,
    /// Files whose content changed since they were ingested (old chunks replaced).
    pub replaced: Vec<String>,
    /// Files skipped, with the reason (not UTF-8, unsupported type, empty).
    pub skipped: Vec<(String, String)>,
    /// Files in the index that are no longer under the documents directory: their chunks
    /// were removed (the index mirrors the directory it is fed).
    pub removed: Vec<String>,
    /// Chunks added.
    pub chunks_added: usize,
}

/// The index in memory.
pub struct VectorIndex {
    dir: PathBuf,
    meta: IndexMeta,
    chunks: Vec<Chunk>,
    /// Row-major `chunks.len() x dim`, unit rows.
    embeddings: Vec<f32>,
}

/// FNV-1a 64 as hex (a content fingerprint, not a security hash).
fn fnv1a(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Cuts a document into chunks: paragraphs (blank-line separated) are packed into chunks of at
/// most `words` words; a paragraph longer than that is cut with `overlap` words repeated.
pub fn chunk_text(text: &str, chunking: Chunking) -> Vec<String> {
    let words_max = chunking.words.max(1);
    let step = words_max.saturating_sub(chunking.overlap).max(1);
    let mut out = Vec::new();
    let mut current: Vec<&str> = Vec::new();
    for para in text.split("\n\n") {
        let words: Vec<&str> = para.split_whitespace().collect();
        if words.is_empty() {
            continue;
        }
        if current.len() + words.len() <= words_max {
            current.extend(&words);
            continue;
        }
        if !current.is_empty() {
            out.push(current.join(" "));
            current.clear();
        }
        if words.len() <= words_max {
            current.extend(&words);
            continue;
        }
        let mut start = 0;
        loop {
            let end = (start + words_max).min(words.len());
            out.push(words[start..end].join(" "));
            if end == words.len() {
                break;
            }
            start += step;
        }
    }
    if !current.is_empty() {
        out.push(current.join(" "));
    }
    out
}

impl VectorIndex {
    /// A new empty index for `embedder` (not written until [`VectorIndex::save`]).
    pub fn create(dir: &Path, embedder: &EmbedderId, dim: usize, chunking: Chunking) -> Self {
        VectorIndex {
            dir: dir.to_path_buf(),
            meta: IndexMeta {
                format: INDEX_FORMAT,
                embedder: embedder.clone(),
                dim,
                chunking,
                files: Vec::new(),
            },
            chunks: Vec::new(),
            embeddings: Vec::new(),
        }
    }

    /// Opens an index directory.
    pub fn open(dir: &Path) -> Result<Self, IndexError> {
        let meta_path = dir.join("index.json");
        let text = std::fs::read_to_string(&meta_path).map_err(|e| IndexError::Io {
            path: meta_path.clone(),
            message: format!(
                "{e}; build the index first with `argo-exp ingest --docs DIR --index {}`",
                dir.display()
            ),
        })?;
        let meta: IndexMeta = serde_json::from_str(&text).map_err(|e| IndexError::Corrupt {
            path: meta_path.clone(),
            message: format!("{e}; rebuild it with `argo-exp ingest --rebuild`"),
        })?;
        if meta.format != INDEX_FORMAT {
            return Err(IndexError::Corrupt {
                path: meta_path,
                message: format!(
                    "format {} but this fleet reads format {INDEX_FORMAT}; rebuild it",
                    meta.format
                ),
            });
        }
        let chunks_path = dir.join("chunks.jsonl");
        let file = std::fs::File::open(&chunks_path).map_err(|e| IndexError::Io {
            path: chunks_path.clone(),
            message: e.to_string(),
        })?;
        let mut chunks = Vec::new();
        for (n, line) in BufReader::new(file).lines().enumerate() {
            let line = line.map_err(|e| IndexError::Io {
                path: chunks_path.clone(),
                message: e.to_string(),
            })?;
            let chunk: Chunk = serde_json::from_str(&line).map_err(|e| IndexError::Corrupt {
                path: chunks_path.clone(),
                message: format!("line {}: {e}", n + 1),
            })?;
            chunks.push(chunk);
        }
        let emb_path = dir.join("embeddings.f32");
        let bytes = std::fs::read(&emb_path).map_err(|e| IndexError::Io {
            path: emb_path.clone(),
            message: e.to_string(),
        })?;
        if bytes.len() != chunks.len() * meta.dim * 4 {
            return Err(IndexError::Corrupt {
                path: emb_path,
                message: format!(
                    "{} bytes, but {} chunks x {} dims x 4 = {}: the files do not belong together; rebuild the index",
                    bytes.len(),
                    chunks.len(),
                    meta.dim,
                    chunks.len() * meta.dim * 4
                ),
            });
        }
        let embeddings = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Ok(VectorIndex {
            dir: dir.to_path_buf(),
            meta,
            chunks,
            embeddings,
        })
    }

    /// Writes the index atomically (temporary files renamed into place).
    pub fn save(&self) -> Result<(), IndexError> {
        std::fs::create_dir_all(&self.dir).map_err(|e| IndexError::Io {
            path: self.dir.clone(),
            message: e.to_string(),
        })?;
        let write = |name: &str, bytes: &[u8]| -> Result<(), IndexError> {
            let path = self.dir.join(name);
            let tmp = self.dir.join(format!(".{name}.tmp"));
            let io = |e: std::io::Error| IndexError::Io {
                path: path.clone(),
                message: e.to_string(),
            };
            let mut f = std::fs::File::create(&tmp).map_err(io)?;
            f.write_all(bytes).map_err(io)?;
            f.sync_all().map_err(io)?;
            std::fs::rename(&tmp, &path).map_err(io)
        };
        let mut emb = Vec::with_capacity(self.embeddings.len() * 4);
        for v in &self.embeddings {
            emb.extend_from_slice(&v.to_le_bytes());
        }
        let mut chunks = String::new();
        for c in &self.chunks {
            chunks.push_str(&serde_json::to_string(c).unwrap_or_default());
            chunks.push('\n');
        }
        // Data first, index.json last: a kill in between leaves sizes that disagree, which
        // `open` reports, rather than a valid-looking mix.
        write("embeddings.f32", &emb)?;
        write("chunks.jsonl", chunks.as_bytes())?;
        let meta = serde_json::to_string_pretty(&self.meta).unwrap_or_default();
        write("index.json", meta.as_bytes())
    }

    /// The metadata.
    pub fn meta(&self) -> &IndexMeta {
        &self.meta
    }

    /// The chunks.
    pub fn chunks(&self) -> &[Chunk] {
        &self.chunks
    }

    /// Chunk by id.
    pub fn chunk(&self, id: u64) -> Option<&Chunk> {
        self.chunks.get(id as usize)
    }

    /// Errors unless `embedder` is the one that built the index.
    pub fn check_embedder(&self, embedder: &EmbedderId) -> Result<(), IndexError> {
        self.meta
            .embedder
            .check_compatible(embedder)
            .map_err(|e| IndexError::EmbedderMismatch {
                path: self.dir.clone(),
                message: e.to_string(),
            })
    }

    /// Errors unless the index was built with `chunking` (chunks of different sizes would mix).
    pub fn check_chunking(&self, chunking: Chunking) -> Result<(), IndexError> {
        let built = self.meta.chunking;
        if built == chunking {
            return Ok(());
        }
        Err(IndexError::ChunkingMismatch {
            path: self.dir.clone(),
            built_words: built.words,
            built_overlap: built.overlap,
            asked_words: chunking.words,
            asked_overlap: chunking.overlap,
        })
    }

    /// A digest of the index's files as saved (chunks, embeddings, metadata): what a run's
    /// manifest records, so that records made with another corpus are not resumed.
    pub fn content_digest(&self) -> Result<String, IndexError> {
        let files: Vec<PathBuf> = ["index.json", "chunks.jsonl", "embeddings.f32"]
            .iter()
            .map(|f| self.dir.join(f))
            .collect();
        fleet_data::digest::files_digest(&files).map_err(|(path, e)| IndexError::Io {
            path,
            message: format!("{e}; save the index (argo-exp ingest) before using it"),
        })
    }

    /// Ingests the `.txt`, `.md`, `.rst` and `.pdf` files under `docs` (recursively, in sorted order): new
    /// files are chunked and embedded, unchanged ones skipped, changed ones replaced, and files
    /// of the index no longer under `docs` removed — the index mirrors one directory.
    /// `on_file` is called after each file (for a progress bar).
    pub fn ingest_dir(
        &mut self,
        docs: &Path,
        embedder: &SentenceEmbedder,
        on_file: &mut dyn FnMut(&str, usize),
    ) -> Result<IngestReport, IndexError> {
        self.check_embedder(embedder.id())?;
        let mut files = Vec::new();
        collect_files(docs, &mut files)?;
        files.sort();
        if files.is_empty() {
            return Err(IndexError::Empty(format!(
                "{}: no files found; give a directory of .txt or .md documents",
                docs.display()
            )));
        }
        let mut report = IngestReport::default();
        let present: std::collections::HashSet<String> = files
            .iter()
            .map(|p| p.strip_prefix(docs).unwrap_or(p).display().to_string())
            .collect();
        let gone: Vec<String> = self
            .meta
            .files
            .iter()
            .filter(|f| !present.contains(&f.path))
            .map(|f| f.path.clone())
            .collect();
        for path in gone {
            self.remove_source(&path);
            report.removed.push(path);
        }
        let known: HashMap<String, String> = self
            .meta
            .files
            .iter()
            .map(|f| (f.path.clone(), f.hash.clone()))
            .collect();
        for path in files {
            let rel = path
                .strip_prefix(docs)
                .unwrap_or(&path)
                .display()
                .to_string();
            let ext = path
                .extension()
                .and_then(|e| e.to_str())
                .unwrap_or("")
                .to_ascii_lowercase();
            // reStructuredText and Markdown are read as they are, like plain text.
            if !matches!(ext.as_str(), "txt" | "md" | "rst" | "pdf") {
                report
                    .skipped
                    .push((rel, "not a .txt, .md, .rst or .pdf file".into()));
                continue;
            }
            let bytes = std::fs::read(&path).map_err(|e| IndexError::Io {
                path: path.clone(),
                message: e.to_string(),
            })?;
            let hash = fnv1a(&bytes);
            match known.get(&rel) {
                Some(h) if *h == hash => {
                    report.unchanged.push(rel);
                    continue;
                }
                Some(_) => {
                    self.remove_source(&rel);
                    report.replaced.push(rel.clone());
                }
                None => {}
            }
            let text = if ext == "pdf" {
                // pdf-extract can panic on malformed files; a bad PDF is skipped, not fatal.
                let extracted = std::panic::catch_unwind(|| {
                    pdf_extract::extract_text_from_mem(&bytes).map_err(|e| e.to_string())
                })
                .unwrap_or_else(|_| Err("the PDF parser gave up on this file".into()));
                match extracted {
                    Ok(text) => text,
                    Err(e) => {
                        report.skipped.push((
                            rel,
                            format!("no text could be read from this PDF ({e}); convert it with pdftotext"),
                        ));
                        continue;
                    }
                }
            } else {
                match String::from_utf8(bytes.clone()) {
                    Ok(text) => text,
                    Err(_) => {
                        report.skipped.push((rel, "not UTF-8 text".into()));
                        continue;
                    }
                }
            };
            let pieces = chunk_text(&text, self.meta.chunking);
            if pieces.is_empty() {
                report.skipped.push((rel, "no text".into()));
                continue;
            }
            let vectors = embedder.embed_vecs(&pieces)?;
            for (piece, v) in pieces.iter().zip(vectors) {
                self.push(rel.clone(), piece.clone(), v);
            }
            self.meta.files.push(IndexedFile {
                path: rel.clone(),
                bytes: bytes.len() as u64,
                hash,
                chunks: pieces.len(),
            });
            report.chunks_added += pieces.len();
            on_file(&rel, pieces.len());
            if !report.replaced.contains(&rel) {
                report.added.push(rel);
            }
        }
        Ok(report)
    }

    fn push(&mut self, source: String, text: String, mut v: Vec<f32>) {
        normalize(&mut v);
        self.chunks.push(Chunk {
            id: self.chunks.len() as u64,
            source,
            text,
        });
        self.embeddings.extend(v);
    }

    /// Drops a file's chunks and renumbers the rest.
    fn remove_source(&mut self, source: &str) {
        let dim = self.meta.dim;
        let mut chunks = Vec::with_capacity(self.chunks.len());
        let mut embeddings = Vec::with_capacity(self.embeddings.len());
        for (i, c) in self.chunks.drain(..).enumerate() {
            if c.source != source {
                embeddings.extend_from_slice(&self.embeddings[i * dim..(i + 1) * dim]);
                chunks.push(Chunk {
                    id: chunks.len() as u64,
                    ..c
                });
            }
        }
        self.chunks = chunks;
        self.embeddings = embeddings;
        self.meta.files.retain(|f| f.path != source);
    }

    /// The `k` chunks most similar (cosine) to each query vector, best first, computed exactly
    /// as one matrix product on `device`.
    pub fn search(
        &self,
        queries: &[Vec<f32>],
        k: usize,
        device: &Device,
    ) -> Result<Vec<Vec<Hit>>, IndexError> {
        if self.chunks.is_empty() {
            return Err(IndexError::Empty(format!(
                "index {} has no chunks: ingest documents first",
                self.dir.display()
            )));
        }
        if queries.is_empty() {
            return Ok(Vec::new());
        }
        let dim = self.meta.dim;
        let mut q = Vec::with_capacity(queries.len() * dim);
        for v in queries {
            if v.len() != dim {
                return Err(IndexError::Corrupt {
                    path: self.dir.clone(),
                    message: format!("query vector has {} dims, the index {dim}", v.len()),
                });
            }
            let mut v = v.clone();
            normalize(&mut v);
            q.extend(v);
        }
        let q = Tensor::from_vec(q, (queries.len(), dim), device)?;
        let e = Tensor::from_slice(&self.embeddings, (self.chunks.len(), dim), device)?;
        let scores: Vec<Vec<f32>> = q.matmul(&e.t()?)?.to_vec2()?;
        Ok(scores
            .into_iter()
            .map(|row| {
                let mut order: Vec<usize> = (0..row.len()).collect();
                let k = k.min(row.len());
                // Ties broken by id, so results do not depend on the sort's internals.
                order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
                order[..k]
                    .iter()
                    .map(|&i| Hit {
                        id: i as u64,
                        score: row[i],
                    })
                    .collect()
            })
            .collect())
    }
}

fn normalize(v: &mut [f32]) {
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if n > 0.0 {
        v.iter_mut().for_each(|x| *x /= n);
    }
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), IndexError> {
    let entries = std::fs::read_dir(dir).map_err(|e| IndexError::Io {
        path: dir.to_path_buf(),
        message: format!("{e}; --docs must be a directory of documents"),
    })?;
    for entry in entries {
        let path = entry
            .map_err(|e| IndexError::Io {
                path: dir.to_path_buf(),
                message: e.to_string(),
            })?
            .path();
        if path.is_dir() {
            collect_files(&path, out)?;
        } else {
            out.push(path);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_pack_paragraphs_and_cut_long_ones_with_overlap() {
        let c = Chunking {
            words: 5,
            overlap: 2,
        };
        assert_eq!(chunk_text("a b\n\nc d\n\n\n", c), vec!["a b c d"]);
        let long = "1 2 3 4 5 6 7 8";
        assert_eq!(chunk_text(long, c), vec!["1 2 3 4 5", "4 5 6 7 8"]);
        assert_eq!(
            chunk_text("x y z\n\n1 2 3 4 5 6", c),
            vec!["x y z", "1 2 3 4 5", "4 5 6"]
        );
        assert!(chunk_text("  \n\n ", c).is_empty());
    }
}
