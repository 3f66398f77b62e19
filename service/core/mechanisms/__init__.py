"""One module per mechanism (SPEC §2), the decoy and personal estimators beside theirs
(`decoy_reconstruction`, `personal_reconstruction`), and the registry that lists them all
for the rest of the service (`registry`)."""
