//! `[devices]`: where training runs.

use serde::{Deserialize, Serialize};

use super::error::{ConfigError, at_most};

/// Which backend runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendChoice {
    /// CUDA when a driver and a GPU are present, else the CPU with a notice.
    Auto,
    /// CUDA; an error when no usable GPU is found.
    Cuda,
    /// The CPU backend (Burn's Flex), even where a GPU is present.
    Cpu,
}

/// Which of the visible GPUs to use (`devices.use`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// Every visible GPU.
    All,
    /// `devices.count` GPUs with the most free memory (at least `min_free_mib`),
    /// preferring well-connected sets.
    Auto,
    /// These logical CUDA indices (after `CUDA_VISIBLE_DEVICES`), in this order.
    List(Vec<usize>),
}

impl Serialize for Selection {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Selection::All => s.serialize_str("all"),
            Selection::Auto => s.serialize_str("auto"),
            Selection::List(v) => v.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Selection {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Selection;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("\"all\", \"auto\" or a list of logical GPU indices such as [0, 1]")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Selection, E> {
                match v {
                    "all" => Ok(Selection::All),
                    "auto" => Ok(Selection::Auto),
                    other => Err(E::invalid_value(serde::de::Unexpected::Str(other), &self)),
                }
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Selection, E> {
                usize::try_from(v)
                    .map(|i| Selection::List(vec![i]))
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(v), &self))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Selection, A::Error> {
                let mut out = Vec::new();
                while let Some(i) = seq.next_element::<usize>()? {
                    out.push(i);
                }
                if out.is_empty() {
                    return Err(serde::de::Error::invalid_length(0, &self));
                }
                Ok(Selection::List(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// `[devices]`: where training runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DevicesConfig {
    pub backend: BackendChoice,
    /// Sets `CUDA_VISIBLE_DEVICES` for this process before CUDA starts, e.g. `"1,3"`.
    /// Empty: leave the environment as it is. A different value already in the
    /// environment is an error.
    pub visible: String,
    /// Which visible GPUs to use: `"all"`, `"auto"` or logical indices like `[0, 1]`.
    #[serde(rename = "use")]
    pub select: Selection,
    /// With `use = "auto"`: how many GPUs.
    pub count: usize,
    /// GPUs with less free memory than this (MiB, from NVML) are not used; naming one
    /// in `use` is an error.
    pub min_free_mib: u64,
    /// With `backend = "auto"`: refuse to fall back to the CPU.
    pub require_gpu: bool,
    /// Position in the chosen GPUs of the main device, which holds metrics (and, in
    /// data-parallel mode, the optimizer).
    pub main: usize,
    /// Where compiled CUDA kernels and autotune results are kept between runs. Empty:
    /// `$KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`.
    pub cache_dir: String,
}

impl Default for DevicesConfig {
    fn default() -> Self {
        Self {
            backend: BackendChoice::Auto,
            visible: String::new(),
            select: Selection::All,
            count: 1,
            min_free_mib: 0,
            require_gpu: false,
            main: 0,
            cache_dir: String::new(),
        }
    }
}

impl DevicesConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.count == 0 {
            return Err(ConfigError::invalid("devices.count", 0, "at least 1"));
        }
        at_most("devices.count", self.count as u64, 1024, "GPUs")?;
        if let Selection::List(ids) = &self.select {
            at_most("devices.use", ids.len() as u64, 1024, "GPUs")?;
            if self.main >= ids.len() {
                return Err(ConfigError::invalid(
                    "devices.main",
                    self.main,
                    format!(
                        "a position in devices.use = {ids:?}, 0 to {}",
                        ids.len() - 1
                    ),
                ));
            }
        }
        Ok(())
    }
}
