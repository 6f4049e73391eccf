"""KV storage for requests. The contiguous cache is the reference; paged comes next."""
