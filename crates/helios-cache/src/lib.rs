//! helios-cache (filled by its issue).
