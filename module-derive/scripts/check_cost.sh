#!/bin/sh
# What `#[module(paths)]` costs a user's `cargo check`: the 200-field struct of
# `src/expansion_cost.rs` (fields `Linear`, `Option<Param>`, `Vec<Block>`, `usize` in turn) in a
# crate of its own, checked with and without typed paths. Dependencies are built once first; each
# timed run re-checks only that crate (its source is touched). Prints one line per run.
#
#     sh module-derive/scripts/check_cost.sh [runs]
#
# The crate lives in `$CARGO_TARGET_DIR/check-cost` (default `target/check-cost`), shares the
# workspace's target folder and `Cargo.lock`, and builds offline.
set -eu
runs=${1:-3}
root=$(cd "$(dirname "$0")/../.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
dir=$target/check-cost
mkdir -p "$dir/src"
cat > "$dir/Cargo.toml" <<EOF
[package]
name = "check-cost"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
module-runtime = { path = "$root/module-runtime" }

[workspace]
EOF
cp "$root/Cargo.lock" "$dir/Cargo.lock"

# $1: the attribute line (empty or `#[module(paths)]`).
generate() {
    {
        echo 'use module_runtime::nn::Linear;'
        echo 'use module_runtime::{Module, Param};'
        echo '#[derive(Module)]'
        echo "$1"
        echo 'pub struct Block { pub fc: Linear }'
        echo '#[derive(Module)]'
        echo "$1"
        echo 'pub struct Wide {'
        i=0
        while [ $i -lt 200 ]; do
            case $((i % 4)) in
                0) echo "    pub field_$i: Linear," ;;
                1) echo "    pub field_$i: Option<Param>," ;;
                2) echo "    pub field_$i: Vec<Block>," ;;
                *) echo "    pub field_$i: usize," ;;
            esac
            i=$((i + 1))
        done
        echo '}'
    } > "$dir/src/lib.rs"
}

check() {
    CARGO_TARGET_DIR=$target cargo check --offline --quiet --manifest-path "$dir/Cargo.toml"
}

generate ''
check # dependencies
for variant in without with; do
    if [ $variant = with ]; then generate '#[module(paths)]'; else generate ''; fi
    check # warm: the variant's first check
    n=0
    while [ $n -lt "$runs" ]; do
        touch "$dir/src/lib.rs"
        start=$(date +%s%N)
        check
        end=$(date +%s%N)
        echo "$variant #[module(paths)]: $(( (end - start) / 1000000 )) ms"
        n=$((n + 1))
    done
done
