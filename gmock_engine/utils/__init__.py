"""What every layer shares: loguru sinks and rate-limited warnings, percentiles and samples. Pure."""
