"""Origins that resolve a ref to a manifest and serve byte ranges: file, HTTP, S3."""
