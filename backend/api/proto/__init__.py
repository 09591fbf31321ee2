"""The backend API's protocol: backend.proto and its generated stubs beside it
(built by ``make proto``, never committed)."""
