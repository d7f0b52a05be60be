"""The input path's benchmark (``shards --bench``) and the token-file training source."""
