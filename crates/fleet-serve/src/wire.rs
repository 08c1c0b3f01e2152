//! Images on the wire to a replica process: raw RGB8 files in a [`Spool`] (/dev/shm where it
//! exists), the pixels the preprocessing starts from, so the worker sees exactly what the
//! parent has. PNG over the pipe cost the worker's GPU about a second per batch of 32 images
//! of 1024 px (encode, base64, JSON, decode); a file of raw pixels is a copy to memory.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use fleet_models::{ModelError, Result};
use image::DynamicImage;
use serde::{Deserialize, Serialize};

use crate::chat::ChatRequest;

/// The files of one batch's images for a replica process: in /dev/shm (memory) where it
/// exists, else in the temp directory. The worker removes each file once read; whatever is
/// left (a worker that died first) is removed when the spool is dropped.
pub struct Spool {
    dir: PathBuf,
    files: Mutex<Vec<PathBuf>>,
}

impl Spool {
    /// An empty spool for one batch.
    pub(crate) fn new() -> Self {
        let shm = Path::new("/dev/shm");
        let dir = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        Spool {
            dir,
            files: Mutex::new(Vec::new()),
        }
    }

    /// Writes one image's RGB8 pixels to a new file (an RGB8 image as it is, any other
    /// converted, as the preprocessing would).
    fn put(&self, image: &DynamicImage) -> Result<WireImage> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = self
            .dir
            .join(format!("fleet-vl-{}-{n}.rgb", std::process::id()));
        self.files
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(path.clone());
        let converted;
        let rgb = match image.as_rgb8() {
            Some(rgb) => rgb,
            None => {
                converted = image.to_rgb8();
                &converted
            }
        };
        std::fs::write(&path, rgb.as_raw()).map_err(|e| {
            ModelError::Replicas(format!(
                "writing an image for a replica process to {}: {e}",
                path.display()
            ))
        })?;
        Ok(WireImage {
            path,
            width: rgb.width(),
            height: rgb.height(),
        })
    }
}

impl Drop for Spool {
    fn drop(&mut self) {
        for f in self
            .files
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            let _ = std::fs::remove_file(f);
        }
    }
}

/// One image on the wire: the spool file of its RGB8 pixels, row-major.
#[derive(Debug, Serialize, Deserialize)]
struct WireImage {
    path: PathBuf,
    width: u32,
    height: u32,
}

impl WireImage {
    /// Reads (and removes) the file: image `k` of its request.
    fn read(&self, k: usize) -> std::result::Result<DynamicImage, String> {
        let read = std::fs::read(&self.path);
        let _ = std::fs::remove_file(&self.path);
        let bytes = read.map_err(|e| format!("image {k}: reading {}: {e}", self.path.display()))?;
        let want = self.width as usize * self.height as usize * 3;
        if bytes.len() != want {
            return Err(format!(
                "image {k}: {} holds {} bytes, not the {want} of {}x{} RGB pixels",
                self.path.display(),
                bytes.len(),
                self.width,
                self.height
            ));
        }
        image::RgbImage::from_raw(self.width, self.height, bytes)
            .map(DynamicImage::ImageRgb8)
            .ok_or_else(|| format!("image {k}: {}x{} pixels", self.width, self.height))
    }
}

/// A [`ChatRequest`] on the wire: the request itself (serde carries all but its images;
/// borrowed when sent, owned when received) and its images as spool files.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct WireChat<R> {
    request: R,
    images: Vec<WireImage>,
}

impl<'a> WireChat<&'a ChatRequest> {
    /// The request with its images written to `spool`.
    pub(crate) fn new(request: &'a ChatRequest, spool: &Spool) -> Result<Self> {
        let images = request
            .images
            .iter()
            .map(|img| spool.put(img))
            .collect::<Result<_>>()?;
        Ok(WireChat { request, images })
    }
}

impl WireChat<ChatRequest> {
    /// The request with its images read back (and their files removed; every file is, even
    /// when one fails).
    pub(crate) fn into_request(self) -> std::result::Result<ChatRequest, String> {
        let mut request = self.request;
        let mut failed = None;
        for (k, w) in self.images.iter().enumerate() {
            match w.read(k) {
                Ok(img) => request.images.push(Arc::new(img)),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(request),
        }
    }
}
