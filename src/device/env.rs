//! The environment variables that decide which GPUs a process sees, read once into a
//! value. Only this module and the CLI read the environment; everything downstream
//! takes a [`DeviceEnv`].

use serde::Serialize;

pub const VISIBLE: &str = "CUDA_VISIBLE_DEVICES";

/// Names that are legitimately close to `CUDA_VISIBLE_DEVICES`.
const NOT_TYPOS: &[&str] = &[
    "NVIDIA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL",
    "CUDA_DEVICE_ORDER",
];

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DeviceEnv {
    /// `CUDA_VISIBLE_DEVICES`, if set (possibly to the empty string).
    pub visible: Option<String>,
    /// Set variables whose names look like a misspelt `CUDA_VISIBLE_DEVICES`: (name, value).
    pub typos: Vec<(String, String)>,
    /// Slurm's record of the GPUs it allocated (`SLURM_STEP_GPUS`, `SLURM_JOB_GPUS`,
    /// `SLURM_LOCALID`), when running under Slurm.
    pub slurm: Vec<(String, String)>,
    /// `CUDA_VISIBLE_DEVICES` when it is set but not valid UTF-8 (shown lossily).
    pub unreadable: Option<String>,
}

impl DeviceEnv {
    /// Reads the process environment.
    pub fn read() -> Self {
        let mut env = Self::from_vars(
            std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))),
        );
        // Not text: CUDA would read bytes kiln cannot show as they are; refused rather
        // than taken for unset (which would use every GPU).
        if let Some(v) = std::env::var_os(VISIBLE)
            && v.to_str().is_none()
        {
            env.unreadable = Some(v.to_string_lossy().into_owned());
        }
        env
    }

    pub fn from_vars(vars: impl IntoIterator<Item = (String, String)>) -> Self {
        let mut env = DeviceEnv::default();
        for (name, value) in vars {
            if name == VISIBLE {
                env.visible = Some(value);
            } else if ["SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SLURM_LOCALID"]
                .contains(&name.as_str())
            {
                env.slurm.push((name, value));
            } else if looks_like_visible(&name) {
                env.typos.push((name, value));
            }
        }
        env.slurm.sort();
        env.typos.sort();
        env
    }

    /// Where the visible set comes from, in words.
    pub fn source(&self) -> String {
        match (&self.visible, self.slurm.is_empty()) {
            (None, _) => format!("{VISIBLE} is not set: every GPU is visible"),
            (Some(v), true) => format!("{VISIBLE}={v:?} from the environment"),
            (Some(v), false) => {
                let slurm: Vec<String> =
                    self.slurm.iter().map(|(k, v)| format!("{k}={v}")).collect();
                format!("{VISIBLE}={v:?} set by Slurm ({})", slurm.join(", "))
            }
        }
    }
}

fn looks_like_visible(name: &str) -> bool {
    if NOT_TYPOS.contains(&name) {
        return false;
    }
    name.eq_ignore_ascii_case(VISIBLE)
        || strsim::levenshtein(&name.to_ascii_uppercase(), VISIBLE) <= 2
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> DeviceEnv {
        DeviceEnv::from_vars(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())))
    }

    #[test]
    fn misspelt_and_lower_case_names_are_caught_but_relatives_are_not() {
        let e = env(&[
            ("CUDA_VISBLE_DEVICES", "1"),
            ("CUDA_VISIBLE_DEVICE", "1"),
            ("cuda_visible_devices", "1"),
            ("NVIDIA_VISIBLE_DEVICES", "all"),
            ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),
            ("PATH", "/bin"),
        ]);
        let names: Vec<&str> = e.typos.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            names,
            vec![
                "CUDA_VISBLE_DEVICES",
                "CUDA_VISIBLE_DEVICE",
                "cuda_visible_devices"
            ]
        );
        assert_eq!(e.visible, None);
    }

    #[test]
    fn source_names_slurm_when_it_set_the_variable() {
        let e = env(&[("CUDA_VISIBLE_DEVICES", "0,1"), ("SLURM_STEP_GPUS", "2,3")]);
        assert!(
            e.source().contains("set by Slurm (SLURM_STEP_GPUS=2,3)"),
            "{}",
            e.source()
        );
        assert!(env(&[]).source().contains("not set"));
        assert!(
            env(&[("CUDA_VISIBLE_DEVICES", "")])
                .source()
                .contains("\"\"")
        );
    }
}
