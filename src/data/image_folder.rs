//! Image folders: `ROOT/{train,test}/CLASS/*.{png,jpg,jpeg}`. Classes are the sorted
//! sub-folder names of `train/`. Files are listed up front and decoded on loader
//! worker threads, so the folder may be larger than memory.

use std::path::{Path, PathBuf};

use image::DynamicImage;

use super::DataError;
use super::source::{Shape, Source};

const EXTENSIONS: [&str; 3] = ["png", "jpg", "jpeg"];

/// Whether `path` names a PNG or JPEG file by its extension.
pub fn is_image_file(path: &Path) -> bool {
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    EXTENSIONS.contains(&ext.as_str())
}

pub struct ImageFolder {
    files: Vec<(PathBuf, u16)>,
    shape: Shape,
}

/// Class names: the sub-folders of `root/train`, sorted.
pub fn classes(root: &Path) -> Result<Vec<String>, DataError> {
    let train = root.join("train");
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&train).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => DataError::Missing {
            path: train.clone(),
            reason: "not found; an image folder needs ROOT/train/CLASS/*.png|jpg (and ROOT/test/CLASS/...)".into(),
        },
        _ => DataError::Io { path: train.clone(), source },
    })? {
        let entry = entry.map_err(DataError::io(&train))?;
        if entry.path().is_dir() {
            names.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    if names.is_empty() {
        return Err(DataError::Missing {
            path: train,
            reason: "has no class sub-folders".into(),
        });
    }
    names.sort();
    Ok(names)
}

impl ImageFolder {
    /// Lists `root/split`. `side` 0 takes the first image's size; channels follow the
    /// first image (grey: 1, otherwise 3).
    pub fn open(
        root: &Path,
        split: &str,
        classes: &[String],
        side: usize,
        limit: usize,
    ) -> Result<Self, DataError> {
        let dir = root.join(split);
        if !dir.is_dir() {
            return Err(DataError::Missing {
                path: dir,
                reason: "not found; an image folder needs both train/ and test/".into(),
            });
        }
        let mut files = Vec::new();
        let mut subdirs: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map_err(DataError::io(&dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_dir())
            .collect();
        subdirs.sort();
        for class_dir in subdirs {
            let name = class_dir
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            let Some(label) = classes.iter().position(|c| *c == name) else {
                return Err(DataError::malformed(
                    &class_dir,
                    format!(
                        "class `{name}` is not among the training classes ({})",
                        classes.join(", ")
                    ),
                ));
            };
            let mut images = Vec::new();
            for entry in std::fs::read_dir(&class_dir).map_err(DataError::io(&class_dir))? {
                let path = entry.map_err(DataError::io(&class_dir))?.path();
                let file_name = path.file_name().unwrap_or_default().to_string_lossy();
                if file_name.starts_with('.') {
                    continue;
                }
                if !is_image_file(&path) {
                    return Err(DataError::malformed(
                        &path,
                        "unknown image format: expected a .png, .jpg or .jpeg file",
                    ));
                }
                images.push(path);
            }
            if images.is_empty() {
                return Err(DataError::Missing {
                    path: class_dir,
                    reason: "class folder holds no images".into(),
                });
            }
            images.sort();
            files.extend(images.into_iter().map(|p| (p, label as u16)));
        }
        if files.is_empty() {
            return Err(DataError::Missing {
                path: dir,
                reason: "holds no class folders with images".into(),
            });
        }
        if limit > 0 && limit < files.len() {
            // Keep an even spread of classes rather than the first classes only.
            let step = files.len() as f64 / limit as f64;
            files = (0..limit)
                .map(|i| files[(i as f64 * step) as usize].clone())
                .collect();
        }
        let first = decode(&files[0].0)?;
        let channels = match first.color().channel_count() {
            1 | 2 => 1,
            _ => 3,
        };
        let (height, width) = if side > 0 {
            (side, side)
        } else {
            (first.height() as usize, first.width() as usize)
        };
        Ok(ImageFolder {
            files,
            shape: Shape {
                channels,
                height,
                width,
            },
        })
    }
}

impl ImageFolder {
    /// `files` as one unlabelled set, decoded to `shape` (grey or RGB as it says).
    pub fn from_files(files: Vec<PathBuf>, shape: Shape) -> Self {
        ImageFolder {
            files: files.into_iter().map(|f| (f, 0)).collect(),
            shape,
        }
    }
}

fn decode(path: &Path) -> Result<DynamicImage, DataError> {
    image::ImageReader::open(path)
        .map_err(DataError::io(path))?
        .with_guessed_format()
        .map_err(DataError::io(path))?
        .decode()
        .map_err(|source| DataError::Decode {
            path: path.to_path_buf(),
            source,
        })
}

impl Source for ImageFolder {
    fn len(&self) -> usize {
        self.files.len()
    }
    fn shape(&self) -> Shape {
        self.shape
    }
    fn label(&self, index: usize) -> usize {
        self.files[index].1 as usize
    }
    fn check(
        &self,
        known: &std::collections::HashSet<String>,
        good: &mut Vec<String>,
    ) -> Result<(), DataError> {
        use rayon::prelude::*;
        // A file is known by its path, size and modification time: replaced or edited,
        // it is checked again.
        let key = |path: &Path| -> Option<String> {
            let m = std::fs::metadata(path).ok()?;
            let modified = m
                .modified()
                .ok()?
                .duration_since(std::time::UNIX_EPOCH)
                .ok()?
                .as_nanos();
            Some(format!("{}\t{}\t{modified}", path.display(), m.len()))
        };
        let todo: Vec<(&PathBuf, Option<String>)> = self
            .files
            .iter()
            .map(|(p, _)| (p, key(p)))
            .filter(|(_, k)| k.as_ref().is_none_or(|k| !known.contains(k)))
            .collect();
        let results: Vec<Result<Option<String>, DataError>> = todo
            .par_iter()
            .map(|(path, k)| decode(path).map(|_| k.clone()))
            .collect();
        let mut first_error = None;
        for r in results {
            match r {
                Ok(k) => good.extend(k),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn read(&self, index: usize, out: &mut [u8]) -> Result<(), DataError> {
        let path = &self.files[index].0;
        let mut img = decode(path)?;
        let (h, w) = (self.shape.height as u32, self.shape.width as u32);
        if img.height() != h || img.width() != w {
            img = img.resize_exact(w, h, image::imageops::FilterType::Triangle);
        }
        let plane = (h * w) as usize;
        if self.shape.channels == 1 {
            out.copy_from_slice(img.to_luma8().as_raw());
        } else {
            let rgb = img.to_rgb8();
            for (p, px) in rgb.pixels().enumerate() {
                for c in 0..3 {
                    out[c * plane + p] = px.0[c];
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_png(path: &Path, value: u8) {
        let img = image::RgbImage::from_pixel(6, 6, image::Rgb([value, 0, 255 - value]));
        img.save(path).unwrap();
    }

    fn fixture() -> crate::test_util::TempDir {
        let dir = crate::test_util::tempdir();
        for split in ["train", "test"] {
            for (c, class) in ["cat", "dog"].iter().enumerate() {
                let d = dir.path().join(split).join(class);
                std::fs::create_dir_all(&d).unwrap();
                for i in 0..2 {
                    write_png(&d.join(format!("{i}.png")), (c * 100 + i) as u8);
                }
            }
        }
        dir
    }

    #[test]
    fn lists_classes_and_decodes_into_chw() {
        let dir = fixture();
        let classes = classes(dir.path()).unwrap();
        assert_eq!(classes, vec!["cat", "dog"]);
        let set = ImageFolder::open(dir.path(), "train", &classes, 0, 0).unwrap();
        assert_eq!(set.len(), 4);
        assert_eq!(
            set.shape(),
            Shape {
                channels: 3,
                height: 6,
                width: 6
            }
        );
        assert_eq!(set.label(3), 1);
        let mut out = vec![0; set.shape().len()];
        set.read(2, &mut out).unwrap();
        assert_eq!(out[0], 100); // red plane
        assert_eq!(out[36], 0); // green plane
        assert_eq!(out[72], 155); // blue plane
    }

    #[test]
    fn resizes_to_the_requested_side() {
        let dir = fixture();
        let classes = classes(dir.path()).unwrap();
        let set = ImageFolder::open(dir.path(), "test", &classes, 3, 0).unwrap();
        let mut out = vec![0; 27];
        set.read(0, &mut out).unwrap();
        assert_eq!(out[0], 0);
    }

    #[test]
    fn unknown_format_empty_class_and_unknown_class_are_named() {
        let dir = fixture();
        let classes_ = classes(dir.path()).unwrap();
        std::fs::write(dir.path().join("train/cat/notes.txt"), "x").unwrap();
        let msg = ImageFolder::open(dir.path(), "train", &classes_, 0, 0)
            .err()
            .unwrap()
            .to_string();
        assert!(
            msg.contains("notes.txt") && msg.contains("unknown image format"),
            "{msg}"
        );

        std::fs::create_dir(dir.path().join("test/bird")).unwrap();
        let msg = ImageFolder::open(dir.path(), "test", &classes_, 0, 0)
            .err()
            .unwrap()
            .to_string();
        assert!(
            msg.contains("bird") && msg.contains("not among the training classes"),
            "{msg}"
        );

        let empty = crate::test_util::tempdir();
        std::fs::create_dir_all(empty.path().join("train/cat")).unwrap();
        std::fs::create_dir_all(empty.path().join("test")).unwrap();
        let c = classes(empty.path()).unwrap();
        let msg = ImageFolder::open(empty.path(), "train", &c, 0, 0)
            .err()
            .unwrap()
            .to_string();
        assert!(msg.contains("holds no images"), "{msg}");
    }

    #[test]
    fn corrupt_image_is_named_when_read() {
        let dir = fixture();
        let classes = classes(dir.path()).unwrap();
        std::fs::write(dir.path().join("train/dog/1.png"), b"not a png").unwrap();
        let set = ImageFolder::open(dir.path(), "train", &classes, 0, 0).unwrap();
        let mut out = vec![0; set.shape().len()];
        let msg = set.read(3, &mut out).unwrap_err().to_string();
        assert!(
            msg.contains("dog/1.png") && msg.contains("cannot decode"),
            "{msg}"
        );
    }

    #[test]
    fn checking_finds_a_bad_image_and_skips_the_files_checked_before() {
        let dir = fixture();
        let classes = classes(dir.path()).unwrap();
        let set = ImageFolder::open(dir.path(), "test", &classes, 0, 0).unwrap();
        let mut good = Vec::new();
        set.check(&Default::default(), &mut good).unwrap();
        assert_eq!(good.len(), 4);
        let known: std::collections::HashSet<String> = good.into_iter().collect();
        let mut again = Vec::new();
        set.check(&known, &mut again).unwrap();
        assert!(again.is_empty());
        std::fs::write(dir.path().join("test/dog/1.png"), b"not a png").unwrap();
        let msg = set.check(&known, &mut again).unwrap_err().to_string();
        assert!(
            msg.contains("dog/1.png") && msg.contains("cannot decode"),
            "{msg}"
        );
        // The others are still known good; only the file that changed failed.
        assert!(again.is_empty());
    }

    #[test]
    fn missing_train_folder_explains_the_layout() {
        let dir = crate::test_util::tempdir();
        let msg = classes(dir.path()).unwrap_err().to_string();
        assert!(msg.contains("ROOT/train/CLASS"), "{msg}");
    }
}
