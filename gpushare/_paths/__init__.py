"""One module per sharing path; each knows how to export and import."""

__all__: list[str] = []
