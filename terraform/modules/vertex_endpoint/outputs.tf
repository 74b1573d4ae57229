output "endpoint_id" {
  description = "Vertex AI endpoint ID, for gcloud ai endpoints predict / raw-predict."
  value       = google_vertex_ai_endpoint.ferry.name
}

output "predict_url" {
  description = "REST URL of the endpoint's predict method."
  value       = "https://${var.region}-aiplatform.googleapis.com/v1/projects/${var.project}/locations/${var.region}/endpoints/${google_vertex_ai_endpoint.ferry.name}:predict"
}

output "model_repository_uri" {
  description = "Where to upload the Triton model repository (config.pbtxt and version folders)."
  value       = "gs://${google_storage_bucket.models.name}/${var.model_prefix}"
}

output "service_account" {
  description = "Service account the replicas run as (read-only on the model bucket)."
  value       = google_service_account.ferry.email
}
