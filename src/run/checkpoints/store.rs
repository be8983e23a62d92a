//! Checkpoints on disk. Each is a directory `step-NNNNNNNNN/` written as
//! `step-NNNNNNNNN.tmp/`, fsynced, then renamed into place; `manifest.json` (sizes and
//! SHA-256 of every file) is written last, so only a directory with a manifest whose
//! files all match is resumable. `latest` names the newest one and is replaced
//! atomically. Old checkpoints are deleted only after a newer one is complete.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::CheckpointError;
use super::retention::{Entry, to_delete};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    pub bytes: u64,
    pub sha256: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub step: u64,
    /// Test accuracy measured just before this checkpoint, if any (for keep-best).
    pub test_acc: Option<f64>,
    pub files: Vec<FileEntry>,
}

#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
}

const MANIFEST: &str = "manifest.json";

fn dir_name(step: u64) -> String {
    format!("step-{step:09}")
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn sync_dir(path: &Path) -> Result<(), CheckpointError> {
    File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(io(path))
}

fn hash_file(path: &Path) -> Result<(u64, String), CheckpointError> {
    let mut f = File::open(path).map_err(io(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    let digest = hasher.finalize();
    Ok((bytes, digest.iter().map(|b| format!("{b:02x}")).collect()))
}

impl Store {
    pub fn new(run_dir: &Path) -> Self {
        Store {
            root: run_dir.join("checkpoints"),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Writes a checkpoint: `write` fills the temporary directory it is given.
    pub fn save(
        &self,
        step: u64,
        test_acc: Option<f64>,
        write: impl FnOnce(&Path) -> Result<(), CheckpointError>,
    ) -> Result<PathBuf, CheckpointError> {
        std::fs::create_dir_all(&self.root).map_err(io(&self.root))?;
        let name = dir_name(step);
        let tmp = self.root.join(format!("{name}.tmp"));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
        }
        std::fs::create_dir(&tmp).map_err(io(&tmp))?;
        let committed = self.commit(step, test_acc, &name, &tmp, write);
        if committed.is_err() {
            // A full disk must not leave a half-written checkpoint behind.
            let _ = std::fs::remove_dir_all(&tmp);
        }
        committed
    }

    /// Fills `tmp` (`write`), adds the manifest and renames it to `name`.
    fn commit(
        &self,
        step: u64,
        test_acc: Option<f64>,
        name: &str,
        tmp: &Path,
        write: impl FnOnce(&Path) -> Result<(), CheckpointError>,
    ) -> Result<PathBuf, CheckpointError> {
        write(tmp)?;

        let mut files = Vec::new();
        let mut names: Vec<PathBuf> = std::fs::read_dir(tmp)
            .map_err(io(tmp))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        names.sort();
        for path in names {
            File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(io(&path))?;
            let (bytes, sha256) = hash_file(&path)?;
            files.push(FileEntry {
                name: path
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned(),
                bytes,
                sha256,
            });
        }
        let manifest = Manifest {
            step,
            test_acc,
            files,
        };
        let mpath = tmp.join(MANIFEST);
        let mut f = File::create(&mpath).map_err(io(&mpath))?;
        f.write_all(
            serde_json::to_string_pretty(&manifest)
                .expect("manifest serializes")
                .as_bytes(),
        )
        .and_then(|_| f.sync_all())
        .map_err(io(&mpath))?;
        sync_dir(tmp)?;

        let dest = self.root.join(name);
        if dest.exists() {
            // The same step saved again (e.g. stopped right after a resume): swap it out.
            let old = self.root.join(format!("{name}.old"));
            let _ = std::fs::remove_dir_all(&old);
            std::fs::rename(&dest, &old).map_err(io(&dest))?;
            std::fs::rename(tmp, &dest).map_err(io(&dest))?;
            let _ = std::fs::remove_dir_all(&old);
        } else {
            std::fs::rename(tmp, &dest).map_err(io(&dest))?;
        }
        sync_dir(&self.root)?;
        self.write_latest(name)?;
        Ok(dest)
    }

    fn write_latest(&self, name: &str) -> Result<(), CheckpointError> {
        let tmp = self.root.join("latest.tmp");
        let mut f = File::create(&tmp).map_err(io(&tmp))?;
        if let Err(e) = f
            .write_all(format!("{name}\n").as_bytes())
            .and_then(|_| f.sync_all())
        {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(&tmp)(e));
        }
        let latest = self.root.join("latest");
        std::fs::rename(&tmp, &latest).map_err(io(&latest))?;
        sync_dir(&self.root)
    }

    /// Complete-looking checkpoints (a manifest is present), newest first.
    pub fn list(&self) -> Vec<(u64, PathBuf)> {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut found: Vec<(u64, PathBuf)> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.join(MANIFEST).is_file())
            .filter_map(|p| {
                let name = p.file_name()?.to_str()?.to_string();
                let step = name.strip_prefix("step-")?.parse::<u64>().ok()?;
                Some((step, p))
            })
            .collect();
        found.sort_by_key(|(s, _)| std::cmp::Reverse(*s));
        found
    }

    /// Checks every file against the manifest.
    pub fn verify(&self, dir: &Path) -> Result<Manifest, CheckpointError> {
        let mpath = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&mpath).map_err(io(&mpath))?;
        let manifest: Manifest =
            serde_json::from_str(&text).map_err(|e| CheckpointError::Corrupt {
                path: mpath.clone(),
                reason: format!("unreadable manifest: {e}"),
            })?;
        for f in &manifest.files {
            let path = dir.join(&f.name);
            if !path.is_file() {
                return Err(CheckpointError::Corrupt {
                    path,
                    reason: "listed in the manifest but missing".into(),
                });
            }
            let (bytes, sha256) = hash_file(&path)?;
            if bytes != f.bytes {
                return Err(CheckpointError::Corrupt {
                    path,
                    reason: format!("{bytes} bytes, the manifest says {} (truncated?)", f.bytes),
                });
            }
            if sha256 != f.sha256 {
                return Err(CheckpointError::Corrupt {
                    path,
                    reason: "checksum does not match the manifest".into(),
                });
            }
        }
        Ok(manifest)
    }

    /// `step-N` directories without a manifest: a checkpoint whose writing never
    /// finished, or whose manifest was lost.
    pub fn incomplete(&self) -> Vec<PathBuf> {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut found: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.is_dir()
                    && !p.join(MANIFEST).is_file()
                    && p.file_name()
                        .and_then(|n| n.to_str())
                        .and_then(|n| n.strip_prefix("step-"))
                        .is_some_and(|n| n.parse::<u64>().is_ok())
            })
            .collect();
        found.sort();
        found
    }

    /// The newest checkpoint that verifies; each one skipped is passed to `skipped`.
    pub fn latest_valid(
        &self,
        mut skipped: impl FnMut(&CheckpointError),
    ) -> Option<(PathBuf, Manifest)> {
        for (_, dir) in self.list() {
            match self.verify(&dir) {
                Ok(m) => return Some((dir, m)),
                Err(e) => skipped(&e),
            }
        }
        None
    }

    /// The verified checkpoint with the best test accuracy.
    pub fn best_valid(&self) -> Option<(PathBuf, Manifest)> {
        self.list()
            .into_iter()
            .filter_map(|(_, dir)| self.verify(&dir).ok().map(|m| (dir, m)))
            .filter(|(_, m)| m.test_acc.is_some_and(|a| !a.is_nan()))
            .max_by(|a, b| {
                a.1.test_acc
                    .unwrap_or(0.0)
                    .total_cmp(&b.1.test_acc.unwrap_or(0.0))
            })
    }

    /// Applies retention after step `saved` was written. Directories without a
    /// manifest are not touched, nor checkpoints newer than `saved`.
    pub fn prune(
        &self,
        saved: u64,
        keep_last: usize,
        keep_best: bool,
    ) -> Result<(), CheckpointError> {
        let listed = self.list();
        let entries: Vec<Entry> = listed
            .iter()
            .map(|(step, dir)| Entry {
                step: *step,
                test_acc: std::fs::read_to_string(dir.join(MANIFEST))
                    .ok()
                    .and_then(|t| serde_json::from_str::<Manifest>(&t).ok())
                    .and_then(|m| m.test_acc),
            })
            .collect();
        for step in to_delete(&entries, saved, keep_last, keep_best) {
            let dir = self.root.join(dir_name(step));
            std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn save(store: &Store, step: u64, acc: Option<f64>) -> PathBuf {
        store
            .save(step, acc, |dir| {
                std::fs::write(dir.join("weights.bin"), vec![step as u8; 100]).unwrap();
                Ok(())
            })
            .unwrap()
    }

    #[test]
    fn save_commits_by_rename_and_updates_latest() {
        let run = crate::test_util::tempdir();
        let store = Store::new(run.path());
        let dir = save(&store, 7, None);
        assert!(dir.ends_with("step-000000007"));
        assert!(!run.path().join("checkpoints/step-000000007.tmp").exists());
        let latest = std::fs::read_to_string(run.path().join("checkpoints/latest")).unwrap();
        assert_eq!(latest.trim(), "step-000000007");
        assert_eq!(store.verify(&dir).unwrap().files[0].bytes, 100);
    }

    #[test]
    fn truncated_or_altered_checkpoints_are_skipped_for_the_previous_good_one() {
        let run = crate::test_util::tempdir();
        let store = Store::new(run.path());
        save(&store, 1, None);
        let second = save(&store, 2, None);
        let third = save(&store, 3, None);
        std::fs::write(third.join("weights.bin"), vec![0u8; 10]).unwrap(); // truncated
        std::fs::write(second.join("weights.bin"), vec![9u8; 100]).unwrap(); // altered
        let mut skipped = Vec::new();
        let (dir, m) = store.latest_valid(|e| skipped.push(e.to_string())).unwrap();
        assert_eq!(m.step, 1);
        assert!(dir.ends_with("step-000000001"));
        assert_eq!(skipped.len(), 2);
        assert!(skipped[0].contains("truncated"), "{}", skipped[0]);
        assert!(skipped[1].contains("checksum"), "{}", skipped[1]);
    }

    #[test]
    fn a_directory_without_manifest_is_not_a_checkpoint() {
        let run = crate::test_util::tempdir();
        let store = Store::new(run.path());
        save(&store, 1, None);
        std::fs::create_dir_all(run.path().join("checkpoints/step-000000005")).unwrap();
        std::fs::create_dir_all(run.path().join("checkpoints/step-000000006.tmp")).unwrap();
        assert_eq!(
            store.list().iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            vec![1]
        );
    }

    #[test]
    fn a_step_directory_without_its_manifest_is_reported_as_incomplete() {
        let run = crate::test_util::tempdir();
        let store = Store::new(run.path());
        save(&store, 1, None);
        let second = save(&store, 2, None);
        std::fs::remove_file(second.join(MANIFEST)).unwrap();
        assert_eq!(store.incomplete(), vec![second]);
        assert_eq!(store.list().len(), 1);
    }

    #[test]
    fn prune_keeps_last_k_and_best() {
        let run = crate::test_util::tempdir();
        let store = Store::new(run.path());
        for (step, acc) in [(1, 0.5), (2, 0.9), (3, 0.6), (4, 0.7)] {
            save(&store, step, Some(acc));
            store.prune(step, 2, true).unwrap();
        }
        let left: Vec<u64> = store.list().iter().map(|(s, _)| *s).collect();
        assert_eq!(left, vec![4, 3, 2]);
        assert_eq!(store.best_valid().unwrap().1.step, 2);
    }

    #[test]
    fn saving_the_same_step_twice_replaces_it() {
        let run = crate::test_util::tempdir();
        let store = Store::new(run.path());
        save(&store, 4, None);
        save(&store, 4, Some(0.3));
        assert_eq!(store.list().len(), 1);
        assert_eq!(
            store.verify(&store.list()[0].1).unwrap().test_acc,
            Some(0.3)
        );
    }
}
