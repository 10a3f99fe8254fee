"""The runtime-core format on the Python side: schema, typed manifest, writer."""
