//! module-runtime's integration tests, gathered into one test binary (each file was a binary of
//! its own, and each linked candle again): a file is one area, its tests are named `area::test`.

mod conv_options;
mod device_map;
mod nn_activations;
mod nn_dropout;
mod nn_embedding;
mod nn_fixture;
mod nn_linear_each;
mod nn_losses;
mod nn_pool_norm;
mod nn_sdpa;
mod nn_shape;
mod nn_transformer;
mod nn_transformer_classifier;
mod nn_upsample;
mod pool_options;
mod pth_files;
mod pth_hostile;
mod sequential_named;
mod tensor_struct_derive;
