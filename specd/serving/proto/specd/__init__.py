"""Generated from proto/specd/v1/specd.proto by `make proto`; do not edit."""
