//! module-optim's integration tests, through the public API only, gathered into one test binary
//! (as the rest of the workspace does: one binary links candle once). A file is one area; its tests
//! are named `area::test` (`cargo test -p module-optim --test integration state::` runs one area).
//! The PyTorch traces `parity` compares with are the repository's `fixtures/pytorch/`.

mod fsdp;
mod fsdp_tables;
mod grad_scaler;
mod groups;
mod parity;
mod precision;
mod pth;
mod pth_scheduler;
mod readme;
mod rules;
mod sharded_grad_scaler;
mod state;
mod swa;
mod zero;
