//! Recurrent layers: [`Lstm`] and [`Gru`] (PyTorch's `nn.LSTM`/`nn.GRU`, one generic type,
//! [`RnnBase`]) and the one-step cells [`LstmCell`] and [`GruCell`] (PyTorch's
//! `nn.LSTMCell`/`nn.GRUCell`, one generic type, [`RnnCellBase`]), with the gate math
//! ([`LstmGates`], [`GruGates`]) as their type parameter. All four implement
//! [`Recurrent`]: `initial_state(batch)`, a one-step call that takes and returns the state, and a
//! whole-sequence call from a state.

// Bottom up: each file uses only those above it. The gate math (the type parameter of both kinds),
// the configuration of a stack, and the weights under PyTorch's names:
mod gates;

mod config;

mod weights;

// The cells and the stacks, on those three:
mod cell;

mod sequence;

pub use cell::{GruCell, LstmCell, RnnCellBase, RnnCellBasePath, RnnCellConfig};
pub use config::RnnConfig;
pub use gates::{Gates, GruGates, LstmGates};
pub use sequence::{Gru, Lstm, RnnBase, RnnBasePath};
