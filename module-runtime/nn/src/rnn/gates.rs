//! The gate math that tells an LSTM from a GRU, and the state checks they share.

use std::fmt::Debug;

use candle_core::{Shape, Tensor};

use crate::error::{Error, Result};
use crate::TensorTree;

/// The gate math of a recurrent layer or cell, the one thing that tells an LSTM from a GRU: the
/// type parameter of [`RnnBase`](super::RnnBase) and [`RnnCellBase`](super::RnnCellBase).
pub trait Gates: Clone + Copy + Debug + Send + Sync + 'static {
    /// The layer's name in error messages (`"Lstm"`).
    const NAME: &'static str;
    /// The cell's name in error messages (`"LstmCell"`).
    const CELL_NAME: &'static str;
    /// PyTorch's class name of the layer (`"LSTM"`), which summaries show.
    const CLASS_NAME: &'static str;
    /// PyTorch's class name of the cell (`"LSTMCell"`).
    const CELL_CLASS_NAME: &'static str;
    /// The first layer's input weight, `Lstm.weight_ih_l0`, named in device mismatch errors.
    const FIRST_WEIGHT: &'static str;
    /// The cell's input weight, `LstmCell.weight_ih`, named in device mismatch errors.
    const CELL_WEIGHT: &'static str;
    /// Number of gate blocks of `hidden_size` rows in each weight.
    const GATES: usize;
    /// The state tensors of the layer, as shape errors name them (`"Lstm h_0"`, `"Lstm c_0"`):
    /// one `[B, H]` tensor per layer each (`h`, and `c` for an LSTM); the first is the output.
    const STATE_NAMES: &'static [&'static str];
    /// The state tensors of the cell, as shape errors name them (`"LstmCell h"`, …).
    const CELL_STATE_NAMES: &'static [&'static str];
    /// The state as a value: `(h, c)` for an LSTM, `h` for a GRU (each `[num_layers, B, H]` for a
    /// layer, `[B, H]` for a cell).
    type State: TensorTree + Clone + Debug + Send + Sync + 'static;

    /// One time step: from the input projection `gi = x W_ih^T + b_ih` and the hidden projection
    /// `gh = h W_hh^T + b_hh`, both `[B, GATES * H]`, and the state tensors (in
    /// [`STATE_NAMES`](Self::STATE_NAMES) order), the next state tensors.
    fn step(gi: &Tensor, gh: &Tensor, state: &[Tensor]) -> Result<Vec<Tensor>>;

    /// The state tensors, in [`STATE_NAMES`](Self::STATE_NAMES) order, as [`State`](Self::State).
    fn from_tensors(states: Vec<Tensor>) -> Self::State;

    /// The state's tensors, in [`STATE_NAMES`](Self::STATE_NAMES) order.
    fn to_tensors(state: &Self::State) -> Vec<Tensor>;
}

/// The gate math of PyTorch's `nn.LSTM`/`nn.LSTMCell`: gates i, f, g, o, with
/// `c' = f * c + i * g` and `h' = o * tanh(c')`; state `(h, c)`.
#[derive(Clone, Copy, Debug)]
pub struct LstmGates;

impl Gates for LstmGates {
    const NAME: &'static str = "Lstm";
    const CELL_NAME: &'static str = "LstmCell";
    const CLASS_NAME: &'static str = "LSTM";
    const CELL_CLASS_NAME: &'static str = "LSTMCell";
    const FIRST_WEIGHT: &'static str = "Lstm.weight_ih_l0";
    const CELL_WEIGHT: &'static str = "LstmCell.weight_ih";
    const GATES: usize = 4;
    const STATE_NAMES: &'static [&'static str] = &["Lstm h_0", "Lstm c_0"];
    const CELL_STATE_NAMES: &'static [&'static str] = &["LstmCell h", "LstmCell c"];
    /// `(h, c)`.
    type State = (Tensor, Tensor);

    fn step(gi: &Tensor, gh: &Tensor, state: &[Tensor]) -> Result<Vec<Tensor>> {
        let (h_prev, c_prev) = (&state[0], &state[1]);
        let h = h_prev.dim(1)?;
        let gates = (gi + gh)?;
        let i = sigmoid(&gates.narrow(1, 0, h)?)?;
        let f = sigmoid(&gates.narrow(1, h, h)?)?;
        let g = gates.narrow(1, 2 * h, h)?.tanh()?;
        let o = sigmoid(&gates.narrow(1, 3 * h, h)?)?;
        let c = ((f * c_prev)? + (i * g)?)?;
        let h = (o * c.tanh()?)?;
        Ok(vec![h, c])
    }

    fn from_tensors(states: Vec<Tensor>) -> (Tensor, Tensor) {
        let mut states = states.into_iter();
        match (states.next(), states.next()) {
            (Some(h), Some(c)) => (h, c),
            _ => unreachable!("an LSTM state is two tensors"),
        }
    }

    fn to_tensors((h, c): &(Tensor, Tensor)) -> Vec<Tensor> {
        vec![h.clone(), c.clone()]
    }
}

/// The gate math of PyTorch's `nn.GRU`/`nn.GRUCell`: gates r, z, n, with
/// `n = tanh(W_in x + b_in + r * (W_hn h + b_hn))` and `h' = (1 - z) * n + z * h`; state `h`.
#[derive(Clone, Copy, Debug)]
pub struct GruGates;

impl Gates for GruGates {
    const NAME: &'static str = "Gru";
    const CELL_NAME: &'static str = "GruCell";
    const CLASS_NAME: &'static str = "GRU";
    const CELL_CLASS_NAME: &'static str = "GRUCell";
    const FIRST_WEIGHT: &'static str = "Gru.weight_ih_l0";
    const CELL_WEIGHT: &'static str = "GruCell.weight_ih";
    const GATES: usize = 3;
    const STATE_NAMES: &'static [&'static str] = &["Gru h_0"];
    const CELL_STATE_NAMES: &'static [&'static str] = &["GruCell h"];
    /// `h`.
    type State = Tensor;

    fn step(gi: &Tensor, gh: &Tensor, state: &[Tensor]) -> Result<Vec<Tensor>> {
        let h_prev = &state[0];
        let h = h_prev.dim(1)?;
        let r = sigmoid(&(gi.narrow(1, 0, h)? + gh.narrow(1, 0, h)?)?)?;
        let z = sigmoid(&(gi.narrow(1, h, h)? + gh.narrow(1, h, h)?)?)?;
        let n = (gi.narrow(1, 2 * h, h)? + (r * gh.narrow(1, 2 * h, h)?)?)?.tanh()?;
        // (1 - z) * n + z * h, with one multiplication.
        Ok(vec![(&n + (z * (h_prev - &n)?)?)?])
    }

    fn from_tensors(states: Vec<Tensor>) -> Tensor {
        match states.into_iter().next() {
            Some(h) => h,
            None => unreachable!("a GRU state is one tensor"),
        }
    }

    fn to_tensors(h: &Tensor) -> Vec<Tensor> {
        vec![h.clone()]
    }
}

fn sigmoid(x: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::ops::sigmoid(x)?)
}

/// Checks that every state tensor has the `expected` shape, naming the tensor and the shapes.
pub(super) fn check_state(
    names: &[&'static str],
    states: &[Tensor],
    expected: &[usize],
    what: &str,
) -> Result<()> {
    if states.len() != names.len() {
        return Err(Error::InputShape {
            layer: names.first().copied().unwrap_or("state"),
            expected: format!("{} state tensors", names.len()),
            got: Shape::from_dims(&[states.len()]),
        });
    }
    for (name, s) in names.iter().zip(states) {
        if s.dims() != expected {
            return Err(Error::InputShape {
                layer: name,
                expected: format!("{expected:?} ({what})"),
                got: s.shape().clone(),
            });
        }
    }
    Ok(())
}
