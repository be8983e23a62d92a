//! GPU usage over an epoch: samples of NVML's memory and utilisation of each device
//! (every 25 steps and at the end of each epoch), summed up as a line for the epoch
//! report. The sampler decides when to sample.

use super::nvml::{GpuUsage, UsageMonitor};
use crate::report::DeviceUsage;

/// NVML is sampled every this many steps (and at the end of each epoch).
const EVERY_STEPS: u64 = 25;

/// Samples GPU usage when due and keeps the epoch's peak memory and mean utilisation.
pub struct UsageSampler {
    monitor: Option<UsageMonitor>,
    window: UsageWindow,
}

impl UsageSampler {
    /// `None`: no GPUs to watch (the CPU); the sampler then does nothing.
    pub fn new(monitor: Option<UsageMonitor>) -> Self {
        UsageSampler {
            monitor,
            window: UsageWindow::default(),
        }
    }

    pub fn maybe_sample(&mut self, step: u64, end_of_epoch: bool) {
        if let Some(m) = &self.monitor
            && (end_of_epoch || step.is_multiple_of(EVERY_STEPS))
        {
            self.window.add(&m.sample());
        }
    }

    /// The epoch's line (devices named `names`) and, per device, its name, peak memory
    /// in GiB and mean utilisation in percent; a fresh window for the next epoch.
    pub fn take(&mut self, names: &[String]) -> (Option<String>, Vec<DeviceUsage>) {
        let window = std::mem::take(&mut self.window);
        let per_device = window
            .devices
            .iter()
            .zip(names)
            .filter_map(|(d, name)| {
                let (peak, _, sum, n) = (*d)?;
                Some(DeviceUsage {
                    name: name.clone(),
                    memory_gib: peak as f64 / 1024.0,
                    busy_percent: (n > 0).then(|| sum as f64 / n as f64),
                })
            })
            .collect();
        (window.line(names), per_device)
    }
}

/// Peak memory and mean utilisation of each device over one epoch's samples.
#[derive(Default)]
struct UsageWindow {
    /// Per device: (peak used MiB, total MiB, utilisation sum, utilisation samples).
    devices: Vec<Option<(u64, u64, u64, u64)>>,
}

impl UsageWindow {
    fn add(&mut self, sample: &[Option<GpuUsage>]) {
        self.devices
            .resize(sample.len().max(self.devices.len()), None);
        for (acc, s) in self.devices.iter_mut().zip(sample) {
            let Some(s) = s else { continue };
            let (peak, total, sum, n) = acc.get_or_insert((0, s.total_mib, 0, 0));
            *peak = (*peak).max(s.used_mib);
            *total = s.total_mib;
            if let Some(u) = s.utilization_pct {
                *sum += u as u64;
                *n += 1;
            }
        }
    }

    fn line(&self, names: &[String]) -> Option<String> {
        let gib = |mib: u64| mib as f64 / 1024.0;
        let parts: Vec<String> = self
            .devices
            .iter()
            .zip(names)
            .filter_map(|(d, name)| {
                let (peak, total, sum, n) = (*d)?;
                let util = sum
                    .checked_div(n)
                    .map(|u| format!(", {u}% busy"))
                    .unwrap_or_default();
                Some(format!(
                    "{name} {:.1}/{:.0} GiB in use{util}",
                    gib(peak),
                    gib(total)
                ))
            })
            .collect();
        (!parts.is_empty()).then(|| parts.join(" | "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_usage_line_shows_peak_memory_and_mean_utilisation() {
        let u = |used, pct| {
            Some(GpuUsage {
                used_mib: used,
                total_mib: 143_360,
                utilization_pct: Some(pct),
            })
        };
        let mut w = UsageWindow::default();
        assert_eq!(w.line(&["cuda:0".into()]), None);
        w.add(&[u(2048, 90), None]);
        w.add(&[u(7680, 100), None]);
        assert_eq!(
            w.line(&["cuda:0".into(), "cuda:1".into()]).unwrap(),
            "cuda:0 7.5/140 GiB in use, 95% busy"
        );
    }
}
