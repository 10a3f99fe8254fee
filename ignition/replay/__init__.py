"""The torch-free Python replay of an exported runtime core (`ignition replay CORE`)."""
