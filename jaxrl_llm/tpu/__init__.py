"""TPU programs compiled without a TPU: chip figures and topologies (`chips`), the
compile-only run of a config for a topology (`compile_for`, `--compile_for=v6e:2x4`) and
what it reports (`report`)."""
