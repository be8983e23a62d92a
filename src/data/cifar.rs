//! The CIFAR-10 binary archive as its authors distribute it (`cifar-10-binary.tar.gz`,
//! unpacked): `data_batch_1.bin`..`data_batch_5.bin` and `test_batch.bin`, each a run
//! of 3073-byte records (one label byte, then 1024 R, 1024 G, 1024 B bytes).

use std::path::{Path, PathBuf};

use super::DataError;
use super::source::{InMemory, Shape};

const SIDE: usize = 32;
const RECORD: usize = 1 + 3 * SIDE * SIDE;

pub const CLASSES: [&str; 10] = [
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
];

/// `root` itself when it holds the batches, else `root/cifar-10-batches-bin`.
pub fn locate(root: &Path) -> Result<PathBuf, DataError> {
    for dir in [root.to_path_buf(), root.join("cifar-10-batches-bin")] {
        if dir.join("test_batch.bin").is_file() {
            return Ok(dir);
        }
    }
    Err(DataError::Missing {
        path: root.to_path_buf(),
        reason: "no test_batch.bin here or in cifar-10-batches-bin/; download the CIFAR-10 binary version \
                 (cifar-10-binary.tar.gz) from https://www.cs.toronto.edu/~kriz/cifar.html, unpack it, and \
                 point data.root at it"
            .into(),
    })
}

/// The class names, from `batches.meta.txt` when present.
pub fn classes(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("batches.meta.txt"))
        .ok()
        .map(|t| {
            t.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(String::from)
                .collect::<Vec<_>>()
        })
        .filter(|names| names.len() == CLASSES.len())
        .unwrap_or_else(|| CLASSES.iter().map(|s| s.to_string()).collect())
}

pub fn read_train(dir: &Path) -> Result<InMemory, DataError> {
    let files: Vec<PathBuf> = (1..=5)
        .map(|i| dir.join(format!("data_batch_{i}.bin")))
        .collect();
    read_files(&files)
}

pub fn read_test(dir: &Path) -> Result<InMemory, DataError> {
    read_files(&[dir.join("test_batch.bin")])
}

fn read_files(files: &[PathBuf]) -> Result<InMemory, DataError> {
    let shape = Shape {
        channels: 3,
        height: SIDE,
        width: SIDE,
    };
    let mut pixels = Vec::new();
    let mut labels = Vec::new();
    for path in files {
        if !path.is_file() {
            return Err(DataError::Missing {
                path: path.clone(),
                reason: "missing from the CIFAR-10 batches folder".into(),
            });
        }
        let bytes = std::fs::read(path).map_err(DataError::io(path))?;
        if bytes.is_empty() || bytes.len() % RECORD != 0 {
            return Err(DataError::malformed(
                path,
                format!(
                    "{} bytes is not a whole number of {RECORD}-byte CIFAR-10 records (truncated or not a CIFAR-10 batch)",
                    bytes.len()
                ),
            ));
        }
        pixels.reserve(bytes.len());
        for (i, rec) in bytes.chunks_exact(RECORD).enumerate() {
            if rec[0] as usize >= CLASSES.len() {
                return Err(DataError::malformed(
                    path,
                    format!("record {i} has label {}, expected 0..9", rec[0]),
                ));
            }
            labels.push(rec[0] as u16);
            pixels.extend_from_slice(&rec[1..]);
        }
    }
    Ok(InMemory {
        shape,
        pixels,
        labels,
    })
}

#[cfg(test)]
pub fn write_batch(path: &Path, labels: &[u8]) {
    let mut bytes = Vec::new();
    for (i, &l) in labels.iter().enumerate() {
        bytes.push(l);
        bytes.extend((0..RECORD - 1).map(|p| ((p + i) % 256) as u8));
    }
    std::fs::write(path, bytes).unwrap();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> crate::test_util::TempDir {
        let dir = crate::test_util::tempdir();
        let sub = dir.path().join("cifar-10-batches-bin");
        std::fs::create_dir(&sub).unwrap();
        for i in 1..=5 {
            write_batch(&sub.join(format!("data_batch_{i}.bin")), &[0, 1, 2]);
        }
        write_batch(&sub.join("test_batch.bin"), &[9, 8]);
        dir
    }

    #[test]
    fn reads_batches_from_the_parent_folder() {
        let dir = fixture();
        let found = locate(dir.path()).unwrap();
        let train = read_train(&found).unwrap();
        assert_eq!(train.labels.len(), 15);
        assert_eq!(
            train.shape,
            Shape {
                channels: 3,
                height: 32,
                width: 32
            }
        );
        let test = read_test(&found).unwrap();
        assert_eq!(test.labels, vec![9, 8]);
        // Record 1's first pixel byte is (0 + 1) % 256.
        assert_eq!(test.pixels[3072], 1);
        assert_eq!(classes(&found)[0], "airplane");
    }

    #[test]
    fn truncated_batch_is_named() {
        let dir = fixture();
        let path = dir.path().join("cifar-10-batches-bin/data_batch_3.bin");
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        let msg = read_train(&locate(dir.path()).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("data_batch_3.bin") && msg.contains("3073-byte"),
            "{msg}"
        );
    }

    #[test]
    fn missing_archive_says_where_to_get_it() {
        let dir = crate::test_util::tempdir();
        let msg = locate(dir.path()).unwrap_err().to_string();
        assert!(msg.contains("cifar-10-binary.tar.gz"), "{msg}");
    }

    #[test]
    fn bad_label_is_reported() {
        let dir = fixture();
        write_batch(
            &dir.path().join("cifar-10-batches-bin/test_batch.bin"),
            &[1, 12],
        );
        let msg = read_test(&locate(dir.path()).unwrap())
            .unwrap_err()
            .to_string();
        assert!(msg.contains("record 1 has label 12"), "{msg}");
    }
}
