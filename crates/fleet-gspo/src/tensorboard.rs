//! TensorBoard event files (`report_to = "tensorboard"`): the scalars of `metrics.jsonl`, as
//! transformers' `TensorBoardCallback` names them (`train/<key>` for a step's metrics,
//! `eval/<key>` for an evaluation's `eval_<key>`), in `<output_dir>/runs/`.
//!
//! The file is TensorFlow's record format: for each record its length (u64, little-endian),
//! the masked CRC-32C of the length, the data, the masked CRC-32C of the data; each record an
//! `Event` protobuf (`tensorflow/core/util/event.proto`), the first holding the file version
//! `brain.Event:2`, the others a `Summary` of `simple_value`s at a step. Every event is written
//! and flushed as it comes, so a killed run leaves a file TensorBoard reads to its last event;
//! a resumed run first cuts the events of steps after its checkpoint out of the older files
//! ([`truncate_after`]), then writes a new file.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use prost::Message;

/// `tensorflow.Event`, the fields fleet writes.
#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(oneof = "What", tags = "3, 5")]
    what: Option<What>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value` with a `simple_value`.
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

/// The record format's CRC: CRC-32C, rotated right by 15 and offset.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// An open event file.
pub struct EventWriter {
    file: File,
    path: PathBuf,
}

impl EventWriter {
    /// Creates `dir/events.out.tfevents.<seconds>.<host>.<pid>` (the directory too) and writes
    /// the file-version event.
    pub fn create(dir: &Path) -> std::io::Result<EventWriter> {
        std::fs::create_dir_all(dir)?;
        let now = wall_time();
        let host = std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}",
            now as u64,
            std::process::id()
        ));
        let file = File::create(&path)?;
        let mut w = EventWriter { file, path };
        w.write(&Event {
            wall_time: now,
            step: 0,
            what: Some(What::FileVersion("brain.Event:2".into())),
        })?;
        Ok(w)
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `scalars` (tag, value) at `step`; values that are not finite are left out.
    pub fn scalars<'a>(
        &mut self,
        step: u64,
        scalars: impl IntoIterator<Item = (&'a str, f64)>,
    ) -> std::io::Result<()> {
        let value: Vec<SummaryValue> = scalars
            .into_iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(tag, v)| SummaryValue {
                tag: tag.to_string(),
                simple_value: Some(v as f32),
            })
            .collect();
        if value.is_empty() {
            return Ok(());
        }
        self.write(&Event {
            wall_time: wall_time(),
            step: step as i64,
            what: Some(What::Summary(Summary { value })),
        })
    }

    fn write(&mut self, event: &Event) -> std::io::Result<()> {
        let data = event.encode_to_vec();
        let len = (data.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(data.len() + 16);
        record.extend_from_slice(&len);
        record.extend_from_slice(&masked_crc(&len).to_le_bytes());
        record.extend_from_slice(&data);
        record.extend_from_slice(&masked_crc(&data).to_le_bytes());
        self.file.write_all(&record)?;
        self.file.flush()
    }
}

/// The events of one event file's bytes, in order; a torn last record (a kill mid-write) and
/// anything after a record whose CRC does not match are left out.
fn read_events(bytes: &[u8]) -> Vec<Event> {
    let mut events = Vec::new();
    let mut at = 0;
    while at + 12 <= bytes.len() {
        let len_bytes = &bytes[at..at + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes")) as usize;
        let crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().expect("4 bytes"));
        let end = at + 12 + len;
        if crc != masked_crc(len_bytes) || end + 4 > bytes.len() {
            break;
        }
        let data = &bytes[at + 12..end];
        let crc = u32::from_le_bytes(bytes[end..end + 4].try_into().expect("4 bytes"));
        match Event::decode(data) {
            Ok(e) if crc == masked_crc(data) => events.push(e),
            _ => break,
        }
        at = end + 4;
    }
    events
}

/// Cuts the events of steps after `step` out of every event file in `dir` (a run resumed from
/// the checkpoint at `step` redoes them), each file rewritten through a temporary one; does
/// nothing when `dir` does not exist.
pub fn truncate_after(dir: &Path, step: u64) -> std::io::Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if !entry
            .file_name()
            .to_string_lossy()
            .starts_with("events.out.tfevents.")
        {
            continue;
        }
        let bytes = std::fs::read(&path)?;
        let events = read_events(&bytes);
        let kept: Vec<&Event> = events
            .iter()
            .filter(|e| matches!(e.what, Some(What::FileVersion(_))) || e.step as u64 <= step)
            .collect();
        if kept.len() == events.len() && bytes.len() == encoded_len(&events) {
            continue;
        }
        let tmp = path.with_extension("truncating");
        let mut w = EventWriter {
            file: File::create(&tmp)?,
            path: tmp.clone(),
        };
        for e in kept {
            w.write(e)?;
        }
        w.file.sync_all()?;
        std::fs::rename(&tmp, &path)?;
    }
    Ok(())
}

/// Bytes `events` take as records.
fn encoded_len(events: &[Event]) -> usize {
    events.iter().map(|e| e.encoded_len() + 16).sum()
}

fn wall_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The numeric fields of a metrics record (a JSON object; nested objects flattened with `/`)
/// as TensorBoard tags: `train/<key>` for a step, `eval/<key>` for an evaluation's
/// `eval_<key>` (transformers' names); `step` and `epoch` go under `train/` as the callback
/// logs `epoch` too.
pub fn scalars_of(record: &serde_json::Value) -> Vec<(String, f64)> {
    fn walk(prefix: &str, v: &serde_json::Value, out: &mut Vec<(String, f64)>) {
        match v {
            serde_json::Value::Number(n) => {
                if let Some(x) = n.as_f64() {
                    out.push((prefix.to_string(), x));
                }
            }
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    walk(&format!("{prefix}/{k}"), v, out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    let Some(obj) = record.as_object() else {
        return out;
    };
    let eval = obj.contains_key("eval_runtime");
    for (key, value) in obj {
        if key == "step" {
            continue;
        }
        let tag = match key.strip_prefix("eval_") {
            Some(rest) if eval => format!("eval/{rest}"),
            _ if eval => format!("eval/{key}"),
            _ => format!("train/{key}"),
        };
        walk(&tag, value, &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The record framing reads back: lengths, CRCs and the events themselves.
    #[test]
    fn records_frame_events_with_masked_crcs() {
        // The masked CRC of TensorFlow's record format for an empty string (known value).
        assert_eq!(masked_crc(b""), 0xa282_ead8);
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.scalars(3, [("train/loss", 0.5), ("train/nan", f64::NAN)])
            .unwrap();
        let bytes = std::fs::read(w.path()).unwrap();
        let events = read_events(&bytes);
        assert_eq!(encoded_len(&events), bytes.len(), "every record reads back");
        assert_eq!(events.len(), 2);
        assert_eq!(
            events[0].what,
            Some(What::FileVersion("brain.Event:2".into()))
        );
        let Some(What::Summary(s)) = &events[1].what else {
            panic!("no summary")
        };
        assert_eq!(events[1].step, 3);
        assert_eq!(s.value.len(), 1, "the NaN is left out");
        assert_eq!(s.value[0].tag, "train/loss");
        assert_eq!(s.value[0].simple_value, Some(0.5));
    }

    /// A resume from step 2 keeps the file version and the events up to step 2; a torn last
    /// record goes too.
    #[test]
    fn a_resume_cuts_the_later_steps() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        for step in 1..=4 {
            w.scalars(step, [("train/loss", step as f64)]).unwrap();
        }
        let path = w.path().to_path_buf();
        drop(w);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.extend_from_slice(&[7, 0, 0]); // a torn record
        std::fs::write(&path, &bytes).unwrap();
        truncate_after(dir.path(), 2).unwrap();
        let events = read_events(&std::fs::read(&path).unwrap());
        let steps: Vec<i64> = events.iter().map(|e| e.step).collect();
        assert_eq!(steps, vec![0, 1, 2]);
        assert_eq!(
            encoded_len(&events),
            std::fs::metadata(&path).unwrap().len() as usize
        );
        // Nothing to cut: the file stays as it is.
        truncate_after(dir.path(), 9).unwrap();
        assert_eq!(read_events(&std::fs::read(&path).unwrap()).len(), 3);
    }

    #[test]
    fn tags_follow_transformers() {
        let step = serde_json::json!({"step": 2, "loss": 0.1, "rewards/f/mean": 1.0,
            "peak_memory_bytes": {"cpu": 5}, "note": "x"});
        let tags: Vec<String> = scalars_of(&step).into_iter().map(|t| t.0).collect();
        assert_eq!(
            tags,
            vec![
                "train/loss",
                "train/rewards/f/mean",
                "train/peak_memory_bytes/cpu"
            ]
        );
        let eval = serde_json::json!({"step": 4, "epoch": 0.5, "eval_runtime": 1.0,
            "eval_reward": 0.25, "eval_pass@1": 0.5});
        let tags: Vec<String> = scalars_of(&eval).into_iter().map(|t| t.0).collect();
        assert_eq!(
            tags,
            vec!["eval/epoch", "eval/runtime", "eval/reward", "eval/pass@1"]
        );
    }
}
