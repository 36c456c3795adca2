//! Adam's per-parameter state (`step`, `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`) and its state
//! dict entries.

use candle_core::{Device, Shape, Tensor};
use module_core::Param;

use super::AdamOptions;
use crate::error::{Result, StateError};
use crate::state::{param_like, scalar, Buf, ParamState};

/// Adam's state for one parameter (PyTorch's names).
pub(crate) struct AdamState {
    pub(super) step: u64,
    pub(super) exp_avg: Buf,
    pub(super) exp_avg_sq: Buf,
    pub(super) max_exp_avg_sq: Option<Buf>,
}

impl AdamState {
    /// Zero state for `p`: host vectors for the fused pass, tensors like `p` otherwise.
    pub(super) fn zeros(p: &Tensor, amsgrad: bool, host: bool) -> Result<Self> {
        let z = || -> Result<Buf> {
            Ok(if host {
                Buf::Host(vec![0.0; p.elem_count()])
            } else {
                Buf::Tensor(p.zeros_like()?)
            })
        };
        Ok(Self {
            step: 0,
            exp_avg: z()?,
            exp_avg_sq: z()?,
            max_exp_avg_sq: if amsgrad { Some(z()?) } else { None },
        })
    }
}

impl ParamState<AdamOptions> for AdamState {
    const NAMES: &'static [&'static str] = &["step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"];

    fn entries(&self, shape: &Shape, device: &Device) -> Result<Vec<(&'static str, Tensor)>> {
        let mut out = vec![
            // PyTorch keeps `step` as a float32 tensor; a float64 one holds every count exactly
            // up to 2^53.
            ("step", Tensor::new(self.step as f64, &Device::Cpu)?),
            ("exp_avg", self.exp_avg.tensor(shape, device)?),
            ("exp_avg_sq", self.exp_avg_sq.tensor(shape, device)?),
        ];
        if let Some(m) = &self.max_exp_avg_sq {
            out.push(("max_exp_avg_sq", m.tensor(shape, device)?));
        }
        Ok(out)
    }

    fn from_entries(
        take: &mut dyn FnMut(&'static str) -> Option<Tensor>,
        key: &dyn Fn(&str) -> String,
        options: &AdamOptions,
        param: &Param,
    ) -> Result<Self> {
        let mut missing = Vec::new();
        let mut get = |name: &'static str| {
            let t = take(name);
            if t.is_none() {
                missing.push(key(name));
            }
            t
        };
        let step = get("step");
        let exp_avg = get("exp_avg");
        let exp_avg_sq = get("exp_avg_sq");
        let max = if options.amsgrad {
            get("max_exp_avg_sq")
        } else {
            None
        };
        let (Some(step), Some(exp_avg), Some(exp_avg_sq)) = (step, exp_avg, exp_avg_sq) else {
            return Err(StateError::MissingKeys { keys: missing }.into());
        };
        if options.amsgrad && max.is_none() {
            return Err(StateError::MissingKeys { keys: missing }.into());
        }
        let step_key = key("step");
        let s = scalar(&step, &step_key)?;
        if !(s >= 0.0 && s.fract() == 0.0 && s <= 2f64.powi(53)) {
            return Err(StateError::InvalidValue {
                key: step_key,
                reason: format!("{s} is not a step count"),
            }
            .into());
        }
        let buf = |t: Tensor, name: &str| -> Result<Buf> {
            Ok(Buf::Tensor(param_like(t, &key(name), param)?))
        };
        Ok(Self {
            step: s as u64,
            exp_avg: buf(exp_avg, "exp_avg")?,
            exp_avg_sq: buf(exp_avg_sq, "exp_avg_sq")?,
            max_exp_avg_sq: max.map(|t| buf(t, "max_exp_avg_sq")).transpose()?,
        })
    }
}
