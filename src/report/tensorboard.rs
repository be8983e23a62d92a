//! TensorBoard event files: scalars on one step axis, written into the run dir so that
//! `tensorboard --logdir RUN_DIR` shows a run and `--logdir SWEEP_DIR` (or the folder
//! of runs) compares them.
//!
//! An event file is a sequence of records: the data's length (u64, little-endian), a
//! masked CRC-32C of those 8 bytes, the data, a masked CRC-32C of the data. Each
//! record's data is an `Event` protocol buffer; the first says the file's version, the
//! others carry a `Summary` of tagged float values. A resumed run opens a new file
//! beside the old ones, starting with a restart record at its step; TensorBoard reads
//! the files in name order and drops the older files' points from that step on.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;

use super::EpochRecord;

#[derive(Clone, PartialEq, Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(oneof = "What", tags = "3, 5, 7")]
    what: Option<What>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
    #[prost(message, tag = "7")]
    SessionLog(SessionLog),
}

/// A restart: TensorBoard drops what earlier files hold from its step on, so a run
/// resumed from a checkpoint does not plot the steps it trains again twice.
#[derive(Clone, PartialEq, Message)]
struct SessionLog {
    /// 1: START.
    #[prost(int32, tag = "1")]
    status: i32,
}

#[derive(Clone, PartialEq, Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<Value>,
}

#[derive(Clone, PartialEq, Message)]
struct Value {
    #[prost(string, tag = "1")]
    tag: String,
    /// A member of a oneof in TensorBoard's schema: present even when 0.
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

/// The checksum TensorBoard's records carry: CRC-32C, rotated and offset so that a
/// checksum of data holding checksums stays well spread.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One record framing `data`.
fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// An open event file of a run.
pub struct EventWriter {
    file: File,
    path: PathBuf,
}

impl EventWriter {
    /// A new event file in `dir`, its version record written; `resumed_at`: the first
    /// step a resumed run trains.
    pub fn create(dir: &Path, resumed_at: Option<u64>) -> io::Result<Self> {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}",
            now() as u64,
            std::process::id()
        ));
        let file = File::options().create_new(true).append(true).open(&path)?;
        let mut w = EventWriter { file, path };
        w.write(Event {
            wall_time: now(),
            step: 0,
            what: Some(What::FileVersion("brain.Event:2".into())),
        })?;
        if let Some(step) = resumed_at {
            w.write(Event {
                wall_time: now(),
                step: step as i64,
                what: Some(What::SessionLog(SessionLog { status: 1 })),
            })?;
        }
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `values` (tag, value) at `step`; non-finite values are left out. Each call is one
    /// record, handed to the kernel at once: a crash loses at most the record in hand.
    pub fn scalars(&mut self, step: u64, values: &[(String, f64)]) -> io::Result<()> {
        let value: Vec<Value> = values
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(tag, v)| Value {
                tag: tag.clone(),
                simple_value: Some(*v as f32),
            })
            .collect();
        if value.is_empty() {
            return Ok(());
        }
        self.write(Event {
            wall_time: now(),
            step: step as i64,
            what: Some(What::Summary(Summary { value })),
        })
    }

    fn write(&mut self, event: Event) -> io::Result<()> {
        self.file.write_all(&record(&event.encode_to_vec()))
    }
}

/// A run's scalars for TensorBoard. A file that cannot be written is a warning, once,
/// and the run goes on without it: the other reports hold the same numbers.
pub struct Board {
    /// Where the file goes; `None` once it cannot be written (or never: other ranks).
    dir: Option<PathBuf>,
    /// Made with the first scalars, so a run that ends before training has none.
    writer: Option<EventWriter>,
    resumed_at: Option<u64>,
}

/// One device's usage over an epoch: its name, peak memory in GiB, mean utilisation.
pub struct DeviceUsage {
    pub name: String,
    pub memory_gib: f64,
    pub busy_percent: Option<f64>,
}

impl Board {
    /// A board writing into `run_dir`; `None` writes nothing (ranks other than 0).
    /// `resumed_at`: the first step a resumed run trains.
    pub fn open(run_dir: Option<&Path>, resumed_at: Option<u64>) -> Self {
        Board {
            dir: run_dir.map(Path::to_path_buf),
            writer: None,
            resumed_at,
        }
    }

    /// `warn` hears why the file could not be made or written.
    fn put(&mut self, step: u64, values: &[(String, f64)], warn: &dyn Fn(String)) {
        let Some(dir) = &self.dir else { return };
        if self.writer.is_none() {
            match EventWriter::create(dir, self.resumed_at) {
                Ok(w) => self.writer = Some(w),
                Err(e) => {
                    warn(format!(
                        "TensorBoard events not written: cannot create a file in {}: {e}",
                        dir.display()
                    ));
                    self.dir = None;
                    return;
                }
            }
        }
        if let Some(w) = &mut self.writer
            && let Err(e) = w.scalars(step, values)
        {
            warn(format!(
                "TensorBoard events no longer written: {}: {e}",
                w.path().display()
            ));
            self.dir = None;
            self.writer = None;
        }
    }

    /// What the progress display shows at `step`: the epoch's running loss and
    /// accuracy, img/s since the last report, the learning rate and fp16's loss scale.
    #[allow(clippy::too_many_arguments)]
    pub fn progress(
        &mut self,
        step: u64,
        loss: f64,
        accuracy: f64,
        img_per_s: f64,
        lr: f64,
        loss_scale: Option<f64>,
        warn: &dyn Fn(String),
    ) {
        let mut v = vec![
            ("train/running_loss".to_string(), loss),
            ("train/running_accuracy".to_string(), accuracy),
            ("speed/img_per_s".to_string(), img_per_s),
            ("lr".to_string(), lr),
        ];
        if let Some(s) = loss_scale {
            v.push(("loss_scale".to_string(), s));
        }
        self.put(step, &v, warn);
    }

    /// An epoch's record and the devices' usage over it, at its last step.
    pub fn epoch(&mut self, r: &EpochRecord, usage: &[DeviceUsage], warn: &dyn Fn(String)) {
        let mut v = vec![
            ("train/loss".to_string(), r.train_loss),
            ("train/accuracy".to_string(), r.train_acc),
            ("test/loss".to_string(), r.test_loss),
            ("test/accuracy".to_string(), r.test_acc),
            ("speed/epoch_img_per_s".to_string(), r.img_per_s),
            ("speed/epoch_time_s".to_string(), r.epoch_time_s),
            ("speed/data_wait_s".to_string(), r.data_wait_s),
            ("epoch".to_string(), r.epoch as f64),
        ];
        for d in usage {
            let name = tag_part(&d.name);
            v.push((format!("device/{name}/memory_gib"), d.memory_gib));
            if let Some(b) = d.busy_percent {
                v.push((format!("device/{name}/busy_percent"), b));
            }
        }
        self.put(r.step, &v, warn);
    }
}

/// A name TensorBoard groups well: letters, digits, `_`, `-`, `.` and `/` kept, the
/// rest `_`.
pub fn tag_part(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_-./".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect::<String>()
        .trim_matches('_')
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads an event file back: each record's framing and both checksums checked.
    fn read_records(bytes: &[u8]) -> Vec<Event> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let len_bytes = &bytes[at..at + 8];
            let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            let len_crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
            assert_eq!(len_crc, masked_crc(len_bytes), "length checksum");
            let data = &bytes[at + 12..at + 12 + len];
            let crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
            assert_eq!(crc, masked_crc(data), "data checksum");
            out.push(Event::decode(data).unwrap());
            at += 16 + len;
        }
        out
    }

    #[test]
    fn the_checksum_is_crc32c() {
        // CRC-32C's check value (CRC-32 would give 0xCBF43926).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn a_file_holds_its_version_then_one_record_per_call_with_exact_bytes() {
        let dir = crate::test_util::tempdir();
        let mut w = EventWriter::create(dir.path(), None).unwrap();
        w.scalars(
            7,
            &[
                ("train/loss".into(), 0.5),
                ("lr".into(), 0.0),
                ("bad".into(), f64::NAN),
            ],
        )
        .unwrap();
        w.scalars(9, &[("test/accuracy".into(), 0.93)]).unwrap();
        w.scalars(10, &[("only/nan".into(), f64::INFINITY)])
            .unwrap();
        let name = w.path().file_name().unwrap().to_string_lossy().to_string();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        let events = read_records(&std::fs::read(w.path()).unwrap());
        assert_eq!(events.len(), 3);
        assert_eq!(
            events[0].what,
            Some(What::FileVersion("brain.Event:2".into()))
        );
        let Some(What::Summary(s)) = &events[1].what else {
            panic!("{:?}", events[1])
        };
        assert_eq!(events[1].step, 7);
        let tags: Vec<(&str, Option<f32>)> = s
            .value
            .iter()
            .map(|v| (v.tag.as_str(), v.simple_value))
            .collect();
        // A zero is written, a NaN is not.
        assert_eq!(tags, vec![("train/loss", Some(0.5)), ("lr", Some(0.0))]);
        assert_eq!(events[2].step, 9);
        // The wire bytes of a value: field 1 (tag) length-delimited, field 2 a fixed32.
        let v = Value {
            tag: "lr".into(),
            simple_value: Some(0.0),
        };
        assert_eq!(
            v.encode_to_vec(),
            vec![0x0a, 2, b'l', b'r', 0x15, 0, 0, 0, 0]
        );
    }

    #[test]
    fn a_board_makes_its_file_with_the_first_scalars_and_a_failure_warns_once() {
        let dir = crate::test_util::tempdir();
        let mut board = Board::open(Some(dir.path()), None);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        let warnings = std::cell::RefCell::new(Vec::new());
        let warn = |w: String| warnings.borrow_mut().push(w);
        board.progress(4, 1.0, 0.5, 100.0, 0.1, Some(1024.0), &warn);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        assert!(warnings.borrow().is_empty());
        let mut lost = Board::open(Some(&dir.path().join("gone")), None);
        lost.progress(1, 1.0, 0.5, 100.0, 0.1, None, &warn);
        lost.progress(2, 1.0, 0.5, 100.0, 0.1, None, &warn);
        assert_eq!(warnings.borrow().len(), 1, "{:?}", warnings.borrow());
        assert!(warnings.borrow()[0].contains("gone"));
        // Other ranks write nothing.
        Board::open(None, None).progress(1, 1.0, 0.5, 100.0, 0.1, None, &warn);
        assert_eq!(warnings.borrow().len(), 1);
    }

    #[test]
    fn a_resumed_run_starts_its_file_with_a_restart_at_its_step() {
        let dir = crate::test_util::tempdir();
        let w = EventWriter::create(dir.path(), Some(300)).unwrap();
        let events = read_records(&std::fs::read(w.path()).unwrap());
        assert_eq!(events.len(), 2);
        assert_eq!(events[1].step, 300);
        assert_eq!(
            events[1].what,
            Some(What::SessionLog(SessionLog { status: 1 }))
        );
        // Field 7 (`session_log`), length-delimited, holding field 1 (`status`) = 1.
        let bytes = events[1].encode_to_vec();
        assert_eq!(bytes[bytes.len() - 4..], [0x3a, 2, 0x08, 1]);
    }

    #[test]
    fn tags_keep_only_safe_characters() {
        assert_eq!(tag_part("cuda:0 (NVIDIA H200)"), "cuda_0__NVIDIA_H200");
        assert_eq!(tag_part("cpu"), "cpu");
    }
}
