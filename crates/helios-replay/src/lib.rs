//! helios-replay (filled by its issue).
