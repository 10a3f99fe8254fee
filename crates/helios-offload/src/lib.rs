//! helios-offload (filled by its issue).
