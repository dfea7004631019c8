"""One module per parallelism strategy: hand-written variants beside the torch-native ones."""
