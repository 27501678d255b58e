"""Multimodal retrieval: encoders, KB records, the FAISS index, evaluation and the toy world. Import the modules
(``retrieval.index.MultimodalIndex``, ``retrieval.ranking.Hit``): the package imports nothing itself, so the upstream
converters (``retrieval.upstream``) run without torch."""
