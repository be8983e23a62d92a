//! IDX files (LeCun's MNIST format, also Fashion-MNIST), gzip-compressed or raw.
//! A split is an `idx3` image file plus an `idx1` label file.

use std::io::Read;
use std::path::{Path, PathBuf};

use super::DataError;
use super::source::{InMemory, Shape};

const IMAGES_MAGIC: u32 = 0x0000_0803;
const LABELS_MAGIC: u32 = 0x0000_0801;

/// Reads split `prefix` ("train" or "t10k") from `root`, e.g. `train-images-idx3-ubyte.gz`.
pub fn read_split(root: &Path, prefix: &str, num_classes: usize) -> Result<InMemory, DataError> {
    let images_path = find(root, &format!("{prefix}-images-idx3-ubyte"))?;
    let labels_path = find(root, &format!("{prefix}-labels-idx1-ubyte"))?;
    let (shape, count, pixels) = read_images(&images_path)?;
    let labels = read_labels(&labels_path, num_classes)?;
    if labels.len() != count {
        return Err(DataError::malformed(
            &labels_path,
            format!(
                "{} labels for {} images in {}",
                labels.len(),
                count,
                images_path.display()
            ),
        ));
    }
    Ok(InMemory {
        shape,
        pixels,
        labels,
    })
}

/// `name.gz` if present, else `name`.
fn find(root: &Path, name: &str) -> Result<PathBuf, DataError> {
    let gz = root.join(format!("{name}.gz"));
    if gz.is_file() {
        return Ok(gz);
    }
    let raw = root.join(name);
    if raw.is_file() {
        return Ok(raw);
    }
    Err(DataError::Missing {
        path: gz,
        reason: format!("not found (nor {name}); data.root must hold the four IDX files"),
    })
}

/// The whole file, gunzipped when it starts with the gzip magic.
fn read_all(path: &Path) -> Result<Vec<u8>, DataError> {
    let raw = std::fs::read(path).map_err(DataError::io(path))?;
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::with_capacity(raw.len() * 4);
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(|e| DataError::malformed(path, format!("corrupt gzip stream: {e}")))?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

fn be_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(bytes[at..at + 4].try_into().expect("4-byte slice"))
}

fn read_images(path: &Path) -> Result<(Shape, usize, Vec<u8>), DataError> {
    let bytes = read_all(path)?;
    if bytes.len() < 16 {
        return Err(DataError::malformed(
            path,
            format!(
                "truncated header: {} bytes, expected at least 16",
                bytes.len()
            ),
        ));
    }
    let magic = be_u32(&bytes, 0);
    if magic != IMAGES_MAGIC {
        return Err(DataError::malformed(
            path,
            format!(
                "wrong magic number {magic:#010x}, expected {IMAGES_MAGIC:#010x} (an IDX image file of unsigned bytes)"
            ),
        ));
    }
    let count = be_u32(&bytes, 4) as usize;
    let height = be_u32(&bytes, 8) as usize;
    let width = be_u32(&bytes, 12) as usize;
    if height == 0 || width == 0 || height > 4096 || width > 4096 {
        return Err(DataError::malformed(
            path,
            format!("implausible image size {height}x{width}"),
        ));
    }
    let expected = count * height * width;
    let body = &bytes[16..];
    if body.len() != expected {
        return Err(DataError::malformed(
            path,
            format!(
                "{} bytes of pixels, expected {count} images x {height} x {width} = {expected}{}",
                body.len(),
                if body.len() < expected {
                    " (truncated file?)"
                } else {
                    ""
                }
            ),
        ));
    }
    let shape = Shape {
        channels: 1,
        height,
        width,
    };
    Ok((shape, count, body.to_vec()))
}

fn read_labels(path: &Path, num_classes: usize) -> Result<Vec<u16>, DataError> {
    let bytes = read_all(path)?;
    if bytes.len() < 8 {
        return Err(DataError::malformed(
            path,
            format!(
                "truncated header: {} bytes, expected at least 8",
                bytes.len()
            ),
        ));
    }
    let magic = be_u32(&bytes, 0);
    if magic != LABELS_MAGIC {
        return Err(DataError::malformed(
            path,
            format!(
                "wrong magic number {magic:#010x}, expected {LABELS_MAGIC:#010x} (an IDX label file)"
            ),
        ));
    }
    let count = be_u32(&bytes, 4) as usize;
    let body = &bytes[8..];
    if body.len() != count {
        return Err(DataError::malformed(
            path,
            format!(
                "{} label bytes, expected {count}{}",
                body.len(),
                if body.len() < count {
                    " (truncated file?)"
                } else {
                    ""
                }
            ),
        ));
    }
    if let Some((i, &l)) = body
        .iter()
        .enumerate()
        .find(|(_, l)| **l as usize >= num_classes)
    {
        return Err(DataError::malformed(
            path,
            format!(
                "label {l} at index {i} is not a class (0..{})",
                num_classes - 1
            ),
        ));
    }
    Ok(body.iter().map(|&l| l as u16).collect())
}

/// Writes an IDX pair, gzip-compressed when the names end in `.gz`. Used by tests and
/// by users who want to turn their own images into this format.
#[cfg(test)]
pub fn write_split(root: &Path, prefix: &str, side: usize, pixels: &[u8], labels: &[u8], gz: bool) {
    use std::io::Write;
    let write = |name: String, bytes: Vec<u8>| {
        let path = root.join(if gz { format!("{name}.gz") } else { name });
        let mut f = std::fs::File::create(path).unwrap();
        if gz {
            let mut enc = flate2::write::GzEncoder::new(f, flate2::Compression::fast());
            enc.write_all(&bytes).unwrap();
            enc.finish().unwrap();
        } else {
            f.write_all(&bytes).unwrap();
        }
    };
    let mut img = Vec::new();
    img.extend(IMAGES_MAGIC.to_be_bytes());
    img.extend((labels.len() as u32).to_be_bytes());
    img.extend((side as u32).to_be_bytes());
    img.extend((side as u32).to_be_bytes());
    img.extend_from_slice(pixels);
    write(format!("{prefix}-images-idx3-ubyte"), img);
    let mut lab = Vec::new();
    lab.extend(LABELS_MAGIC.to_be_bytes());
    lab.extend((labels.len() as u32).to_be_bytes());
    lab.extend_from_slice(labels);
    write(format!("{prefix}-labels-idx1-ubyte"), lab);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(gz: bool) -> crate::test_util::TempDir {
        let dir = crate::test_util::tempdir();
        let pixels: Vec<u8> = (0..4 * 16).map(|i| i as u8).collect();
        write_split(dir.path(), "train", 4, &pixels, &[0, 1, 2, 9], gz);
        dir
    }

    #[test]
    fn reads_gzip_and_raw_files_alike() {
        for gz in [true, false] {
            let dir = fixture(gz);
            let set = read_split(dir.path(), "train", 10).unwrap();
            assert_eq!(
                set.shape,
                Shape {
                    channels: 1,
                    height: 4,
                    width: 4
                }
            );
            assert_eq!(set.labels, vec![0, 1, 2, 9]);
            assert_eq!(set.pixels[17], 17);
        }
    }

    #[test]
    fn wrong_magic_is_named() {
        let dir = fixture(false);
        let path = dir.path().join("train-images-idx3-ubyte");
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[3] = 0x01;
        std::fs::write(&path, bytes).unwrap();
        let msg = read_split(dir.path(), "train", 10).unwrap_err().to_string();
        assert!(
            msg.contains("train-images-idx3-ubyte") && msg.contains("wrong magic"),
            "{msg}"
        );
    }

    #[test]
    fn truncated_images_are_reported() {
        let dir = fixture(false);
        let path = dir.path().join("train-images-idx3-ubyte");
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 5]).unwrap();
        let msg = read_split(dir.path(), "train", 10).unwrap_err().to_string();
        assert!(msg.contains("truncated"), "{msg}");
    }

    #[test]
    fn label_count_mismatch_is_reported() {
        let dir = fixture(false);
        let pixels: Vec<u8> = vec![0; 3 * 16];
        write_split(dir.path(), "t10k", 4, &pixels, &[0, 1, 2], false);
        // Replace the t10k labels with a 2-label file.
        let mut lab = Vec::new();
        lab.extend(LABELS_MAGIC.to_be_bytes());
        lab.extend(2u32.to_be_bytes());
        lab.extend([0u8, 1]);
        std::fs::write(dir.path().join("t10k-labels-idx1-ubyte"), lab).unwrap();
        let msg = read_split(dir.path(), "t10k", 10).unwrap_err().to_string();
        assert!(msg.contains("2 labels for 3 images"), "{msg}");
    }

    #[test]
    fn corrupt_gzip_and_missing_files_are_named() {
        let dir = fixture(true);
        std::fs::write(
            dir.path().join("train-labels-idx1-ubyte.gz"),
            [0x1f, 0x8b, 0, 1, 2],
        )
        .unwrap();
        let msg = read_split(dir.path(), "train", 10).unwrap_err().to_string();
        assert!(
            msg.contains("train-labels-idx1-ubyte.gz") && msg.contains("gzip"),
            "{msg}"
        );
        let msg = read_split(dir.path(), "t10k", 10).unwrap_err().to_string();
        assert!(
            msg.contains("t10k-images-idx3-ubyte") && msg.contains("not found"),
            "{msg}"
        );
    }

    #[test]
    fn out_of_range_label_is_reported() {
        let dir = crate::test_util::tempdir();
        write_split(dir.path(), "train", 2, &[0; 8], &[0, 10], false);
        let msg = read_split(dir.path(), "train", 10).unwrap_err().to_string();
        assert!(msg.contains("label 10 at index 1"), "{msg}");
    }
}
