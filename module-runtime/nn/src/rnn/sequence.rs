//! [`RnnBase`]: a stack of recurrent layers over whole sequences (`nn.LSTM`, `nn.GRU`).

use std::fmt::Debug;
use std::marker::PhantomData;

use candle_core::{Device, Tensor};

use super::config::RnnConfig;
use super::gates::{check_state, Gates, GruGates, LstmGates};
use super::weights::{LayerWeights, StackedWeights};
use std::fmt::Write;

use crate::device::check_input_device;
use crate::error::{Error, Result};
use crate::{Forward, Mode, Module, Recurrent};
use module_core::{py_float, ExtraRepr};

/// A stack of recurrent layers with the gate math `G`: PyTorch's `nn.LSTM` ([`Lstm`] =
/// `RnnBase<LstmGates>`) and `nn.GRU` ([`Gru`] = `RnnBase<GruGates>`), unidirectional, without
/// projections. PyTorch's base class is `nn.RNNBase`.
///
/// Parameters, with PyTorch's names, layouts and init (uniform on `±1/sqrt(hidden_size)`), for each
/// layer `k`: `weight_ih_lk` `[G·H, in]` (`in` = `input_size` for layer 0, `H` above),
/// `weight_hh_lk` `[G·H, H]`, `bias_ih_lk` and `bias_hh_lk` `[G·H]`, with `G` gate blocks
/// ([`Gates::GATES`]).
///
/// Input `[B, T, input_size]` with `batch_first` (else `[T, B, input_size]`; `[T, input_size]`
/// unbatched). Returns `(output, state)`: `output` `[B, T, H]` (the last layer's `h` at each step)
/// and the final state, each tensor `[num_layers, B, H]` (`[num_layers, H]` unbatched). A state
/// given to the call must have exactly that shape.
///
/// As a [`Recurrent`] module its state is the same value: [`step`](Recurrent::step) takes one
/// time step `[B, input_size]` and returns `[B, H]` with the next state;
/// [`scan`](Recurrent::scan) takes `[B, T, input_size]` whatever `batch_first` says.
///
/// Typed paths into it: [`RnnBasePath`], from [`RnnBase::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
#[module(bound = "G: Gates", class_name = G::CLASS_NAME)]
pub struct RnnBase<G> {
    #[module(flatten)]
    weights: StackedWeights,
    hidden_size: usize,
    batch_first: bool,
    dropout: f64,
    training: Mode,
    #[module(skip)]
    gates: PhantomData<G>,
}

/// Long short-term memory: PyTorch's `nn.LSTM` (unidirectional, no projection). See
/// [`RnnBase`] and [`LstmGates`].
///
/// The four row blocks of each weight are the gates i, f, g, o. Returns `(output, (h_n, c_n))`.
/// Call with `(&x, (&h0, &c0))` to start from a state; plain `&x` starts from zeros.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{Lstm, RnnConfig};
///
/// let dev = Device::Cpu;
/// let config = RnnConfig { num_layers: 2, batch_first: true, ..Default::default() };
/// let lstm = Lstm::with_config(4, 6, config, &dev)?;
/// assert_eq!(lstm.get_parameter("weight_hh_l1")?.shape().dims(), [24, 6]);
/// let x = Tensor::randn(0f32, 1., (2, 5, 4), &dev)?;
/// let (y, (h, c)) = lstm.call(&x)?;
/// assert_eq!(y.dims(), [2, 5, 6]);
/// assert_eq!(h.dims(), [2, 2, 6]);
/// assert_eq!(c.dims(), [2, 2, 6]);
///
/// // One step at a time, with the state explicit (see `Recurrent`).
/// let state = lstm.initial_state(2)?;
/// let (y0, (h, c)) = lstm.step(&x.narrow(1, 0, 1)?.squeeze(1)?, state)?;
/// assert_eq!((y0.dims(), h.dims()), ([2, 6].as_slice(), [2, 2, 6].as_slice()));
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub type Lstm = RnnBase<LstmGates>;

/// Gated recurrent unit: PyTorch's `nn.GRU` (unidirectional). See [`RnnBase`] and [`GruGates`].
///
/// The three row blocks of each weight are the gates r, z, n. Returns `(output, h_n)`. Call with
/// `(&x, &h0)` to start from a state; plain `&x` starts from zeros.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{Gru, RnnConfig};
///
/// let dev = Device::Cpu;
/// let gru = Gru::with_config(4, 6, RnnConfig { batch_first: true, ..Default::default() }, &dev)?;
/// let x = Tensor::randn(0f32, 1., (2, 5, 4), &dev)?;
/// let (y, h) = gru.call(&x)?;
/// assert_eq!((y.dims(), h.dims()), ([2, 5, 6].as_slice(), [1, 2, 6].as_slice()));
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub type Gru = RnnBase<GruGates>;

impl<G: Gates> RnnBase<G> {
    /// A one-layer float32 layer with PyTorch's defaults (`[seq, batch, feature]` inputs).
    pub fn new(input_size: usize, hidden_size: usize, device: &Device) -> Result<Self> {
        Self::with_config(input_size, hidden_size, RnnConfig::default(), device)
    }

    /// A layer built as `config` says, initialized like PyTorch.
    pub fn with_config(
        input_size: usize,
        hidden_size: usize,
        config: RnnConfig,
        device: &Device,
    ) -> Result<Self> {
        if config.num_layers == 0 {
            return Err(Error::InvalidConfig {
                layer: G::NAME,
                message: "num_layers must be at least 1".to_owned(),
            });
        }
        Ok(Self {
            weights: StackedWeights::new(G::GATES, input_size, hidden_size, &config, device)?,
            hidden_size,
            batch_first: config.batch_first,
            dropout: config.dropout,
            training: Mode::new(),
            gates: PhantomData,
        })
    }

    /// The size of the input features.
    pub fn input_size(&self) -> usize {
        self.first_layer().input_size()
    }

    /// The size of the hidden (and cell) states.
    pub fn hidden_size(&self) -> usize {
        self.hidden_size
    }

    /// The number of stacked layers.
    pub fn num_layers(&self) -> usize {
        self.weights.layers.len()
    }

    /// Whether `forward` takes `[batch, seq, feature]` (`true`) or `[seq, batch, feature]`.
    pub fn batch_first(&self) -> bool {
        self.batch_first
    }

    fn first_layer(&self) -> &LayerWeights {
        // `with_config` refuses zero layers.
        &self.weights.layers[0]
    }

    /// The loop shared by every gate math: layout handling, the layer loop and inter-layer
    /// dropout. `x` is `[B, T, in]` when `batch_first`, else `[T, B, in]`, or `[T, in]`. The state
    /// is [`Gates::STATE_NAMES`] tensors `[num_layers, B, H]` (`[num_layers, H]` unbatched), zeros
    /// unless `initial` gives them. Returns the output sequence and the final state tensors.
    fn run(
        &self,
        x: &Tensor,
        batch_first: bool,
        initial: Option<Vec<Tensor>>,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let first = self.first_layer();
        let w = first.weight_ih.tensor()?;
        check_input_device(G::FIRST_WEIGHT, &w, x)?;
        for s in initial.iter().flatten() {
            check_input_device(G::FIRST_WEIGHT, &w, s)?;
        }
        let input_size = first.input_size();
        let unbatched = x.rank() == 2;
        if !matches!(x.rank(), 2 | 3) || x.dims().last() != Some(&input_size) {
            let layout = if batch_first {
                "[batch, seq, {i}]"
            } else {
                "[seq, batch, {i}]"
            };
            return Err(Error::InputShape {
                layer: G::NAME,
                expected: format!("{} or [seq, {{i}}] unbatched", layout)
                    .replace("{i}", &input_size.to_string()),
                got: x.shape().clone(),
            });
        }
        let mut seq = match (unbatched, batch_first) {
            (true, _) => x.unsqueeze(0)?,
            (false, true) => x.clone(),
            (false, false) => x.transpose(0, 1)?,
        };
        let (b, t, _) = seq.dims3()?;
        let num_layers = self.weights.layers.len();
        let initial = match initial {
            Some(states) => {
                let (expected, what) = if unbatched {
                    (
                        vec![num_layers, self.hidden_size],
                        "[num_layers, hidden_size]",
                    )
                } else {
                    (
                        vec![num_layers, b, self.hidden_size],
                        "[num_layers, batch, hidden_size]",
                    )
                };
                check_state(G::STATE_NAMES, &states, &expected, what)?;
                let states = if unbatched {
                    states
                        .iter()
                        .map(|s| s.unsqueeze(1))
                        .collect::<candle_core::Result<Vec<_>>>()?
                } else {
                    states
                };
                Some(states)
            }
            None => None,
        };
        let n_states = G::STATE_NAMES.len();
        // finals[j][k]: state j of layer k after the last step.
        let mut finals: Vec<Vec<Tensor>> = vec![Vec::with_capacity(num_layers); n_states];
        for (k, layer) in self.weights.layers.iter().enumerate() {
            let mut state = match &initial {
                Some(states) => states
                    .iter()
                    .map(|s| s.get(k))
                    .collect::<candle_core::Result<Vec<_>>>()?,
                None => {
                    let zeros = Tensor::zeros((b, self.hidden_size), seq.dtype(), seq.device())?;
                    vec![zeros; n_states]
                }
            };
            let projected = layer.project_sequence(&seq)?;
            let mut outputs = Vec::with_capacity(t);
            for i in 0..t {
                let gi = projected.narrow(1, i, 1)?.squeeze(1)?;
                let gh = layer.project_hidden(&state[0])?;
                state = G::step(&gi, &gh, &state)?;
                outputs.push(state[0].clone());
            }
            seq = Tensor::stack(&outputs, 1)?;
            if self.dropout > 0.0 && self.training.is_training() && k + 1 < num_layers {
                seq = crate::dropout::dropout_in_training(&seq, self.dropout)?;
            }
            for (j, s) in state.into_iter().enumerate() {
                finals[j].push(s);
            }
        }
        let output = match (unbatched, batch_first) {
            (true, _) => seq.squeeze(0)?,
            (false, true) => seq,
            (false, false) => seq.transpose(0, 1)?,
        };
        let finals = finals
            .iter()
            .map(|per_layer| {
                let s = Tensor::stack(per_layer, 0)?;
                if unbatched {
                    s.squeeze(1)
                } else {
                    Ok(s)
                }
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok((output, finals))
    }

    /// [`run`](Self::run) in the layer's own layout, with the final state as a value.
    fn run_forward(&self, x: &Tensor, initial: Option<Vec<Tensor>>) -> Result<(Tensor, G::State)> {
        let (output, finals) = self.run(x, self.batch_first, initial)?;
        Ok((output, G::from_tensors(finals)))
    }
}

impl<G: Gates> Forward<&Tensor> for RnnBase<G> {
    type Output = (Tensor, G::State);

    /// From a zero state.
    fn forward(&self, x: &Tensor) -> Result<Self::Output> {
        self.run_forward(x, None)
    }
}

impl<G: Gates> Forward<Tensor> for RnnBase<G> {
    type Output = (Tensor, G::State);

    fn forward(&self, x: Tensor) -> Result<Self::Output> {
        self.run_forward(&x, None)
    }
}

impl Forward<(&Tensor, (&Tensor, &Tensor))> for Lstm {
    type Output = (Tensor, (Tensor, Tensor));

    /// From the state `(h0, c0)`, each `[num_layers, B, H]`.
    fn forward(&self, (x, (h0, c0)): (&Tensor, (&Tensor, &Tensor))) -> Result<Self::Output> {
        self.run_forward(x, Some(vec![h0.clone(), c0.clone()]))
    }
}

impl Forward<(&Tensor, &Tensor)> for Gru {
    type Output = (Tensor, Tensor);

    /// From the state `h0` `[num_layers, B, H]`.
    fn forward(&self, (x, h0): (&Tensor, &Tensor)) -> Result<Self::Output> {
        self.run_forward(x, Some(vec![h0.clone()]))
    }
}

impl<G: Gates> ExtraRepr for RnnBase<G> {
    fn extra_repr(&self) -> String {
        let mut s = format!("{}, {}", self.input_size(), self.hidden_size);
        if self.num_layers() != 1 {
            let _ = write!(s, ", num_layers={}", self.num_layers());
        }
        if !self.first_layer().has_bias() {
            s.push_str(", bias=False");
        }
        if self.batch_first {
            s.push_str(", batch_first=True");
        }
        if self.dropout != 0.0 {
            let _ = write!(s, ", dropout={}", py_float(self.dropout));
        }
        s
    }
}

impl<G: Gates> candle_core::Module for RnnBase<G> {
    /// The output sequence, from a zero state.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.run_forward(x, None)?.0)
    }
}

impl<G: Gates> Recurrent for RnnBase<G> {
    /// `(h, c)` for an LSTM, `h` for a GRU, each `[num_layers, batch, hidden_size]`: what
    /// `forward` returns as `(h_n, c_n)` / `h_n`.
    type State = G::State;

    /// Zeros, in the parameters' dtype and on their device.
    fn initial_state(&self, batch: usize) -> Result<G::State> {
        let w = self.first_layer().weight_ih.tensor()?;
        let zeros = Tensor::zeros(
            (self.num_layers(), batch, self.hidden_size),
            w.dtype(),
            w.device(),
        )?;
        Ok(G::from_tensors(vec![zeros; G::STATE_NAMES.len()]))
    }

    /// One time step `[batch, input_size]` (or `[input_size]` with an unbatched state
    /// `[num_layers, hidden_size]`) → `[batch, hidden_size]`: the last layer's `h`.
    fn step(&self, input: &Tensor, state: G::State) -> Result<(Tensor, G::State)> {
        let rank = input.rank();
        if !matches!(rank, 1 | 2) {
            return Err(Error::InputShape {
                layer: G::NAME,
                expected: format!("[batch, {0}] or [{0}] (one time step)", self.input_size()),
                got: input.shape().clone(),
            });
        }
        // A sequence of one step: `[B, 1, in]` batch-first, or `[1, in]` unbatched.
        let (output, finals) = self.run(
            &input.unsqueeze(rank - 1)?,
            true,
            Some(G::to_tensors(&state)),
        )?;
        Ok((output.squeeze(rank - 1)?, G::from_tensors(finals)))
    }

    /// `[batch, time, input_size]` → `[batch, time, hidden_size]`, in one pass per layer.
    fn scan(&self, inputs: &Tensor, state: G::State) -> Result<(Tensor, G::State)> {
        if inputs.rank() != 3 || inputs.dim(1)? == 0 {
            return Err(Error::InputShape {
                layer: G::NAME,
                expected: format!("[batch, time >= 1, {}]", self.input_size()),
                got: inputs.shape().clone(),
            });
        }
        let (output, finals) = self.run(inputs, true, Some(G::to_tensors(&state)))?;
        Ok((output, G::from_tensors(finals)))
    }
}
