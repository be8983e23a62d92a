//! `kiln sweep --launcher slurm`: the trials as one Slurm job array. Each array
//! element's index is its trial's; the element runs `kiln sweep --resume DIR --trial
//! INDEX` on the node Slurm picks, which runs the trial's `kiln train` exactly as a
//! local sweep would, in the trial's folder on shared storage, and records how it
//! ended there (`slurm.json`). Every array is named after the sweep folder
//! (`kiln-NAME`), so kiln finds a sweep's elements in the queue by name, even from a
//! submission it could not record; `--resume` waits for those and submits only trials
//! that are neither finished nor queued. `slurm/jobs.json` lists the job ids for people.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

use super::spec::SlurmSpec;

/// One `sbatch` of the sweep: its job id and the trials (array indices) it holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Submission {
    pub job_id: String,
    pub trials: Vec<usize>,
}

/// What an array element records in its trial's folder when the trial ends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ElementRecord {
    /// `kiln train`'s exit code; `None` when a signal ended it.
    pub exit_code: Option<i32>,
    pub wall_s: f64,
    /// `node (job ARRAYJOB_INDEX)`, for the results table.
    pub place: String,
}

pub const RECORD: &str = "slurm.json";

fn jobs_file(sweep_dir: &Path) -> PathBuf {
    sweep_dir.join("slurm").join("jobs.json")
}

/// Whether this sweep was ever submitted to Slurm.
pub fn submitted(sweep_dir: &Path) -> bool {
    jobs_file(sweep_dir).is_file()
}

pub fn load_jobs(sweep_dir: &Path) -> Result<Vec<Submission>, String> {
    let path = jobs_file(sweep_dir);
    match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// Written whole or not at all (a temporary file renamed over the old one).
pub fn save_jobs(sweep_dir: &Path, jobs: &[Submission]) -> std::io::Result<()> {
    let path = jobs_file(sweep_dir);
    std::fs::create_dir_all(path.parent().expect("has a parent"))?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(jobs)?)?;
    std::fs::rename(tmp, path)
}

/// The job name of a sweep's arrays.
pub fn job_name(sweep_dir: &Path) -> String {
    let name = sweep_dir
        .file_name()
        .map_or("sweep".into(), |n| n.to_string_lossy().into_owned());
    format!("kiln-{name}")
}

/// Why Slurm cannot take this sweep folder, if it cannot: `#SBATCH` lines end at white
/// space and read `%` as a file-name pattern.
pub fn unusable_path(sweep_dir: &Path) -> Option<String> {
    let text = sweep_dir.to_string_lossy();
    text.contains(|c: char| c.is_whitespace() || c == '%').then(|| {
        format!(
            "the sweep folder {text} has white space or `%` in its path, which sbatch's #SBATCH lines cannot hold; choose an --output without them"
        )
    })
}

/// Slurm's `--array` list: runs of consecutive indices as ranges (`0-2,5,7-8`).
pub fn array_list(indices: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < indices.len() {
        let mut j = i;
        while j + 1 < indices.len() && indices[j + 1] == indices[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            indices[i].to_string()
        } else {
            format!("{}-{}", indices[i], indices[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

/// A word for a POSIX shell, single-quoted.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Everything the batch script needs.
pub struct Batch<'a> {
    /// The job name ([`job_name`]).
    pub name: &'a str,
    pub sweep_dir: &'a Path,
    pub exe: &'a Path,
    pub trials: &'a [usize],
    /// Array elements at once (`%N`); 0: as many as Slurm allows.
    pub max_parallel: usize,
    /// GPUs per element (`--gres=gpu:N`); 0: none.
    pub gpus: usize,
    pub options: &'a SlurmSpec,
}

/// The `sbatch` script of one submission.
pub fn batch_script(b: &Batch) -> String {
    let mut lines = vec![
        "#!/bin/bash".to_string(),
        "# Written by `kiln sweep --launcher slurm`: one array element per trial, the".into(),
        "# element's index is the trial's.".into(),
        format!("#SBATCH --job-name={}", b.name),
    ];
    let throttle = if b.max_parallel > 0 {
        format!("%{}", b.max_parallel)
    } else {
        String::new()
    };
    lines.push(format!(
        "#SBATCH --array={}{throttle}",
        array_list(b.trials)
    ));
    let out = b.sweep_dir.join("slurm").join("%A_%a.out");
    lines.push(format!("#SBATCH --output={}", out.display()));
    lines.push("#SBATCH --ntasks=1".into());
    if b.gpus > 0 {
        lines.push(format!("#SBATCH --gres=gpu:{}", b.gpus));
    }
    let o = b.options;
    for (flag, value) in [
        ("partition", &o.partition),
        ("time", &o.time),
        ("account", &o.account),
    ] {
        if let Some(v) = value {
            lines.push(format!("#SBATCH --{flag}={v}"));
        }
    }
    for arg in &o.sbatch_args {
        lines.push(format!("#SBATCH {arg}"));
    }
    lines.push(format!(
        "exec {} sweep --resume {} --trial \"$SLURM_ARRAY_TASK_ID\"",
        quote(&b.exe.to_string_lossy()),
        quote(&b.sweep_dir.to_string_lossy())
    ));
    lines.join("\n") + "\n"
}

/// Submits `script`; the job id.
pub fn submit(script: &Path) -> Result<String, String> {
    let out = Command::new("sbatch")
        .arg("--parsable")
        .arg(script)
        .output()
        .map_err(|e| {
            format!("cannot run sbatch ({e}); is Slurm's client installed and on PATH?")
        })?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "sbatch {} failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    // `--parsable` prints `jobid` or `jobid;cluster`.
    let id = stdout.trim().split(';').next().unwrap_or("").to_string();
    if id.is_empty() || !id.chars().all(|c| c.is_ascii_digit()) {
        return Err(format!("sbatch printed no job id: {:?}", stdout.trim()));
    }
    Ok(id)
}

/// The trials of the sweep whose arrays are named `name` that are still queued or
/// running. squeue is asked three times, 5 s apart, before its failure is an error (a
/// busy controller should not end a long wait).
pub fn active_trials(name: &str) -> Result<BTreeSet<usize>, String> {
    let mut last = String::new();
    for attempt in 0..3 {
        if attempt > 0 {
            std::thread::sleep(std::time::Duration::from_secs(5));
        }
        // This user's jobs in every partition (`--all`: hidden ones too), one line per
        // element; asking by job id would fail once Slurm has forgotten the job.
        let out = Command::new("squeue")
            .args(["--me", "--all", "--noheader", "--array", "--format=%j %K"])
            .output()
            .map_err(|e| {
                format!("cannot run squeue ({e}); is Slurm's client installed and on PATH?")
            })?;
        if out.status.success() {
            return Ok(parse_queue(&String::from_utf8_lossy(&out.stdout), name));
        }
        last = String::from_utf8_lossy(&out.stderr).trim().to_string();
    }
    Err(format!("squeue failed three times: {last}"))
}

/// `squeue --format="%j %K"` lines (job name, array index) of the arrays named `name`.
/// A pending element can show as a range of indices (`3-5%2`) until it starts.
pub fn parse_queue(text: &str, name: &str) -> BTreeSet<usize> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let (Some(job), Some(tasks)) = (words.next(), words.next()) else {
            continue;
        };
        if job != name {
            continue;
        }
        let tasks = tasks.split('%').next().unwrap_or("");
        for part in tasks.split(',') {
            let bounds: Vec<Option<usize>> = part.split('-').map(|n| n.parse().ok()).collect();
            match bounds[..] {
                [Some(a)] => {
                    out.insert(a);
                }
                [Some(a), Some(b)] => out.extend(a..=b),
                _ => {}
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_lists_become_ranges() {
        assert_eq!(array_list(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
        assert_eq!(array_list(&[3]), "3");
        assert_eq!(array_list(&[]), "");
    }

    #[test]
    fn the_batch_script_asks_for_what_the_sweep_says() {
        let options = SlurmSpec {
            partition: Some("gpu".into()),
            time: Some("4:00:00".into()),
            account: None,
            sbatch_args: vec!["--qos=high".into()],
        };
        let b = Batch {
            name: "kiln-lr",
            sweep_dir: Path::new("/shared/sweeps/lr-1"),
            exe: Path::new("/opt/it's/kiln"),
            trials: &[0, 1, 3],
            max_parallel: 2,
            gpus: 1,
            options: &options,
        };
        let s = batch_script(&b);
        for line in [
            "#SBATCH --job-name=kiln-lr",
            "#SBATCH --array=0-1,3%2",
            "#SBATCH --output=/shared/sweeps/lr-1/slurm/%A_%a.out",
            "#SBATCH --gres=gpu:1",
            "#SBATCH --partition=gpu",
            "#SBATCH --time=4:00:00",
            "#SBATCH --qos=high",
            r#"exec '/opt/it'\''s/kiln' sweep --resume '/shared/sweeps/lr-1' --trial "$SLURM_ARRAY_TASK_ID""#,
        ] {
            assert!(s.lines().any(|l| l == line), "missing {line:?} in\n{s}");
        }
        assert!(!s.contains("--account"), "{s}");
        let cpu = batch_script(&Batch {
            gpus: 0,
            max_parallel: 0,
            ..b
        });
        assert!(
            !cpu.contains("--gres") && cpu.contains("--array=0-1,3\n"),
            "{cpu}"
        );
    }

    #[test]
    fn the_queue_is_read_for_this_sweeps_arrays_only() {
        let text = "kiln-lr-1 1\nkiln-lr-1 3-5%2\nkiln-other 0\nkiln-lr-1 7,9\ngarbage\n";
        assert_eq!(
            parse_queue(text, "kiln-lr-1"),
            BTreeSet::from([1, 3, 4, 5, 7, 9])
        );
        assert!(parse_queue("", "kiln-lr-1").is_empty());
    }

    #[test]
    fn paths_sbatch_cannot_hold_are_refused() {
        assert!(unusable_path(Path::new("/shared/my sweeps/lr-1")).is_some());
        assert!(unusable_path(Path::new("/shared/100%/lr-1")).is_some());
        assert!(unusable_path(Path::new("/shared/sweeps/lr-1")).is_none());
        assert_eq!(job_name(Path::new("/shared/sweeps/lr-1")), "kiln-lr-1");
    }
}
